"""Tar-layer staging is reserved in the store's space: a pull that cannot fit fails with
``InsufficientSpace`` before it downloads or unpacks (real registry, capacity-limited
stores)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.errors import ImageDigestMismatch, InsufficientSpace
from preheat.store.store import NodeStore
from preheat.testing.registry import ModelLayer, Registry, registry, tar_layer

WEIGHT = "application/vnd.cncf.model.weight.v1.tar"
MiB = 1 << 20


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with registry(tmp_path_factory.mktemp("registry")) as r:
        yield r


def _staged(store: NodeStore) -> list[Path]:
    return [
        p for p in (store.root / "tmp").rglob("*") if p.is_file() and not p.name.endswith(".lock")
    ]


def test_a_layer_bigger_than_the_store_is_refused_before_download(
    reg: Registry, tmp_path: Path
) -> None:
    """A 3 MiB tar layer into a 2 MiB store: refused naming need and free, the layer never
    requested from the registry, nothing left under tmp/ and nothing reserved."""
    layer = tar_layer([("w.bin", os.urandom(3 * MiB))])
    reg.push_model_layers("models/big:v1", [ModelLayer(WEIGHT, layer)])
    digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    store = NodeStore(tmp_path / "store", capacity=2 * MiB, high_watermark=1.0)
    with pytest.raises(InsufficientSpace, match="nothing was downloaded") as info:
        store.pull(f"oci://{reg.ref('models/big:v1')}")
    assert info.value.need >= 3 * MiB and info.value.free <= 2 * MiB
    assert "Raise --capacity" in str(info.value)
    assert reg.requests(f"GET /v2/models/big/blobs/{digest}") == []
    assert _staged(store) == [] and store.usage().reserved == 0 and store.snapshots() == []


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_a_layer_that_unpacks_too_big_is_refused_before_unpacking(
    reg: Registry, tmp_path: Path, compression: str
) -> None:
    """A compressed layer that is small on the wire but unpacks to 4 MiB, into a 2 MiB
    store: downloaded and verified, then refused before one byte is unpacked."""
    layer = tar_layer([("zeros.bin", bytes(4 * MiB))], compression)
    assert len(layer) < MiB
    tag = f"models/zeros-{compression}:v1"
    reg.push_model_layers(tag, [ModelLayer(f"{WEIGHT}+{compression}", layer)])
    store = NodeStore(tmp_path / "store", capacity=2 * MiB, high_watermark=1.0)
    with pytest.raises(InsufficientSpace, match="nothing was unpacked") as info:
        store.pull(f"oci://{reg.ref(tag)}")
    assert info.value.need >= 4 * MiB
    assert _staged(store) == [] and store.usage().reserved == 0 and store.snapshots() == []


def test_a_pull_that_fits_releases_its_staging_reservation(reg: Registry, tmp_path: Path) -> None:
    """With room for staging and the blobs, the pull succeeds and reserves nothing after."""
    layer = tar_layer([("w.bin", os.urandom(MiB))], "gzip")
    reg.push_model_layers("models/fits:v1", [ModelLayer(f"{WEIGHT}+gzip", layer)])
    store = NodeStore(tmp_path / "store", capacity=8 * MiB, high_watermark=1.0)
    got = store.pull(f"oci://{reg.ref('models/fits:v1')}")
    assert (got.snapshot / "w.bin").stat().st_size == MiB
    assert store.usage().reserved == 0 and _staged(store) == []


def test_a_big_tar_layer_is_spliced_in_ranges_and_still_verified(
    reg: Registry, tmp_path: Path
) -> None:
    """A 3 MiB plain tar layer is downloaded in parallel ranges (several GETs of the blob)
    and read in place, with the right files; swapped bytes at the registry are refused as
    a digest mismatch on that path too, nothing published."""
    data = os.urandom(3 * MiB)
    layer = tar_layer([("w.bin", data)])
    reg.push_model_layers("models/ranges:v1", [ModelLayer(WEIGHT, layer)])
    digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    store = NodeStore(tmp_path / "store")
    got = store.pull(f"oci://{reg.ref('models/ranges:v1')}")
    assert (got.snapshot / "w.bin").read_bytes() == data
    assert len(reg.requests(f"GET /v2/models/ranges/blobs/{digest}")) >= 2
    other = tar_layer([("w.bin", os.urandom(3 * MiB))])
    reg.push_model_layers("models/ranges-swapped:v1", [ModelLayer(WEIGHT, other)])
    blob = reg.blob_file("sha256:" + hashlib.sha256(other).hexdigest())
    blob.write_bytes(tar_layer([("../escape.bin", b"x")]).ljust(len(other), b"\0"))
    fresh = NodeStore(tmp_path / "fresh", retries=0)
    with pytest.raises(ImageDigestMismatch, match="refused before unpacking"):
        fresh.pull(f"oci://{reg.ref('models/ranges-swapped:v1')}")
    assert fresh.snapshots() == [] and not (tmp_path / "escape.bin").exists()
