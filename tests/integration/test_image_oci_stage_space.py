"""Tar-layer staging is reserved in the store's space: a pull that cannot fit fails with
``InsufficientSpace`` before it downloads or unpacks (real registry, capacity-limited
stores)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import resource
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.errors import ImageDigestMismatch, InsufficientSpace, UnsupportedMediaType
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


def _zstd_frames(raw: bytes, parts: int, *, sizes: str = "all") -> bytes:
    """``raw`` cut into ``parts`` pieces, each its own zstd frame (as pzstd and seekable
    zstd write them); each declares its content size (``sizes="all"``), or only the
    first one does (``"first"``)."""
    import zstandard

    cut = [len(raw) * i // parts for i in range(parts + 1)]
    out = []
    for n, (a, b) in enumerate(itertools.pairwise(cut)):
        if sizes == "all" or n == 0:
            out.append(zstandard.ZstdCompressor().compress(raw[a:b]))
        else:  # streamed: the frame header has no content size
            co = zstandard.ZstdCompressor().compressobj()
            out.append(co.compress(raw[a:b]) + co.flush())
    return b"".join(out)


def _lying_frame(data: bytes, declared: int) -> bytes:
    """One zstd frame of ``data`` whose header declares ``declared`` bytes (a forged or
    corrupt layer; the layer digest is of these bytes, so it verifies)."""
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=17)
    frame = bytearray(zstandard.ZstdCompressor(compression_params=params).compress(data))
    fhd = frame[4]
    assert fhd >> 6 == 2 and not fhd & 0x23  # 4-byte size, window byte, no dictionary
    frame[6:10] = struct.pack("<I", declared)
    assert zstandard.get_frame_parameters(bytes(frame)).content_size == declared
    return bytes(frame)


@contextlib.contextmanager
def _disk_of(limit: int) -> Iterator[None]:
    """No file this process writes may grow past ``limit`` bytes (EFBIG, as on a full
    disk) while the block runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


@pytest.mark.parametrize("sizes", ["all", "first"])
def test_a_multi_frame_zstd_layer_is_reserved_and_staged_whole(
    reg: Registry, tmp_path: Path, sizes: str
) -> None:
    """A tar+zstd layer in 4 frames (each declaring its size, or only the first): the
    reservation is the whole unpacked tar, not the first frame's 1.1 MiB, so a 2 MiB store
    refuses it before unpacking; a store with room gets every file, byte for byte."""
    files = [("a.bin", os.urandom(256 << 10)), ("zeros.bin", bytes(4 * MiB))]
    files.append(("b.bin", os.urandom(256 << 10)))
    raw = tar_layer(files)
    layer = _zstd_frames(raw, 4, sizes=sizes)
    assert len(layer) < MiB
    tag = f"models/frames-{sizes}:v1"
    reg.push_model_layers(tag, [ModelLayer(f"{WEIGHT}+zstd", layer)])
    _refused_small_whole_big(reg, tmp_path, tag, files, "nothing was unpacked", len(raw))


def _refused_small_whole_big(
    reg: Registry, tmp_path: Path, tag: str, files: list[tuple[str, bytes]], said: str, need: int
) -> None:
    """A 2 MiB store refuses ``tag`` for room (``said``, at least ``need`` bytes) having
    staged less than 1 MiB and leaving nothing behind; a 32 MiB store gets ``files``."""
    small = NodeStore(tmp_path / "small", capacity=2 * MiB, high_watermark=1.0)
    with _disk_of(MiB), pytest.raises(InsufficientSpace, match=said) as info:
        small.pull(f"oci://{reg.ref(tag)}")
    assert info.value.need >= need
    assert _staged(small) == [] and small.usage().reserved == 0 and small.snapshots() == []
    store = NodeStore(tmp_path / "store", capacity=32 * MiB, high_watermark=1.0)
    got = store.pull(f"oci://{reg.ref(tag)}")
    for name, data in files:
        assert (got.snapshot / name).read_bytes() == data
    assert store.usage().reserved == 0 and _staged(store) == []


def test_a_zstd_frame_that_unpacks_past_its_declared_size_is_refused_before_the_disk_fills(
    reg: Registry, tmp_path: Path
) -> None:
    """A layer whose second frame declares 1 MiB but unpacks to 63 MiB: refused as
    unreadable within its declared size (the files this process writes are capped at
    8 MiB, so staging it would fail with EFBIG instead), nothing published or reserved."""
    raw = tar_layer([("zeros.bin", bytes(64 * MiB))])
    layer = _zstd_frames(raw[:MiB], 1) + _lying_frame(raw[MiB:], MiB)
    reg.push_model_layers("models/lying:v1", [ModelLayer(f"{WEIGHT}+zstd", layer)])
    store = NodeStore(tmp_path / "store", capacity=16 * MiB, high_watermark=1.0)
    with _disk_of(8 * MiB), pytest.raises(UnsupportedMediaType, match="not a readable") as info:
        store.pull(f"oci://{reg.ref('models/lying:v1')}")
    assert "too large" not in str(info.value)
    assert _staged(store) == [] and store.usage().reserved == 0 and store.snapshots() == []


def test_an_unpacked_tar_member_is_linked_into_the_fill_not_copied(
    reg: Registry, tmp_path: Path
) -> None:
    """A gzip tar layer's member staged under the store's tmp/ is hard-linked to the fill's
    partial file (one inode, no second copy); a plain tar's member, which stays inside
    its layer file, is not; a pull of each still publishes the right bytes."""
    import asyncio

    from preheat.sources.oci import OciSource, oci_ref

    data = os.urandom(MiB)
    reg.push_model_layers(
        "models/link-gz:v1", [ModelLayer(f"{WEIGHT}+gzip", tar_layer([("w.bin", data)], "gzip"))]
    )
    reg.push_model_layers("models/link-tar:v1", [ModelLayer(WEIGHT, tar_layer([("w.bin", data)]))])
    store = NodeStore(tmp_path / "store")

    async def take(tag: str, dest: Path) -> tuple[bool, bool]:
        """(linked, dest is the staged file's inode) for the member w.bin of ``tag``."""
        src = OciSource(oci_ref(f"oci://{reg.ref(tag)}"))
        src.bind_store(store.layout, {})
        try:
            res = await src.resolve()
            linked = await src.take_file(res.locations["w.bin"], dest)
            mine = [p for p in _staged(store) if p.name == hashlib.sha256(data).hexdigest()]
            same = linked and [os.stat(p).st_ino for p in mine] == [os.stat(dest).st_ino]
            return linked, same
        finally:
            await src.aclose()

    assert asyncio.run(take("models/link-gz:v1", tmp_path / "gz.part")) == (True, True)
    assert (tmp_path / "gz.part").read_bytes() == data
    assert asyncio.run(take("models/link-tar:v1", tmp_path / "tar.part")) == (False, False)
    assert not (tmp_path / "tar.part").exists()
    for tag in ("models/link-gz:v1", "models/link-tar:v1"):
        got = NodeStore(tmp_path / tag.replace("/", "-")).pull(f"oci://{reg.ref(tag)}")
        assert (got.snapshot / "w.bin").read_bytes() == data


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_a_compressed_layer_that_fits_once_is_pulled_not_reserved_twice(
    reg: Registry, tmp_path: Path, compression: str
) -> None:
    """A 4 MiB model in a small compressed tar layer, into a 6 MiB store (room for it
    once, not twice): its staged files become the blobs, so the pull succeeds (its
    reservation holding the model's bytes while it fills), and again after the snapshot
    is deleted (the listing is kept, so the layer is then staged during the fill); nothing
    stays reserved."""
    files = [("zeros.bin", bytes(4 * MiB)), ("w.bin", os.urandom(64 << 10))]
    layer = tar_layer(files, compression)
    assert len(layer) < MiB
    tag = f"models/once-{compression}:v1"
    reg.push_model_layers(tag, [ModelLayer(f"{WEIGHT}+{compression}", layer)])
    store = NodeStore(tmp_path / "store", capacity=6 * MiB, high_watermark=1.0)
    assert min(_pulled_twice(reg, store, tag, files)) >= 4 * MiB


def _pulled_twice(
    reg: Registry, store: NodeStore, tag: str, files: list[tuple[str, bytes]]
) -> list[int]:
    """Pull ``tag`` into ``store`` twice, deleting the snapshot after each (so the second
    stages its layer during the fill): ``files`` each time, then nothing reserved, staged
    or used. Returns the bytes reserved at each pull's first fill report."""
    held: list[int] = []
    pulled: list[str] = []

    def filling(done: int, total: int) -> None:
        if len(held) == len(pulled):  # before any blob of this pull is published
            held.append(store.usage().reserved)

    for _ in range(2):
        got = store.pull(f"oci://{reg.ref(tag)}", progress=filling)
        pulled.append(got.manifest_digest)
        for name, data in files:
            assert (got.snapshot / name).read_bytes() == data
        assert store.usage().reserved == 0 and _staged(store) == []
        assert store.usage().used == sum(len(d) for _, d in files)
        store.delete(got.manifest_digest)
        assert store.usage().used == 0
    assert len(held) == 2
    return held


@contextlib.contextmanager
def _small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (as root), unmounted afterwards."""
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_compressed_layer_that_fits_the_disk_once_is_pulled_not_reserved_twice(
    reg: Registry, tmp_path: Path
) -> None:
    """A 5 MiB model in a small tar+gzip layer, into a store with no capacity on an 8 MiB
    tmpfs (room for it once, not twice): the staged files already on the disk are the
    blobs the fill links, so the pull succeeds (its reservation still holds the model's
    bytes while it fills: other fills see them taken), again after the snapshot is deleted
    (the layer is then staged during the fill), and nothing stays reserved or staged."""
    files = [("zeros.bin", bytes(5 * MiB)), ("w.bin", os.urandom(64 << 10))]
    layer = tar_layer(files, "gzip")
    assert len(layer) < MiB
    reg.push_model_layers("models/disk-once:v1", [ModelLayer(f"{WEIGHT}+gzip", layer)])
    with _small_disk(tmp_path / "mnt", "8m") as mnt:
        store = NodeStore(mnt / "store", fsync=False)
        assert min(_pulled_twice(reg, store, "models/disk-once:v1", files)) >= 5 * MiB


def _gzip_members(raw: bytes, cuts: list[int]) -> bytes:
    """``raw`` cut at ``cuts``, each piece its own gzip member (as pigz -i, bgzip and
    ``cat a.gz b.gz`` write them)."""
    import gzip

    bounds = [0, *cuts, len(raw)]
    return b"".join(gzip.compress(raw[a:b], mtime=0) for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize("last", ["implausible", "plausible"])
def test_a_multi_member_gzip_layer_is_reserved_and_staged_whole(
    reg: Registry, tmp_path: Path, last: str
) -> None:
    """A 4.8 MiB tar+gzip layer in 3 members, whose last ISIZE trailer says only its own
    0.3 MiB or 0.8 MiB: counted before unpacking when that is less than the layer's
    compressed size ("implausible"), else while unpacking, before anything past the
    trailer is written ("plausible"). A 2 MiB store refuses it for room
    having staged less than 1 MiB; a store with room gets every file, byte for byte, and
    nothing stays reserved."""
    rand = os.urandom(512 << 10)
    files = [("zeros.bin", bytes(4 * MiB)), ("a.bin", rand[: 256 << 10])]
    files += [("b.bin", rand[256 << 10 :]), ("c.bin", bytes(256 << 10))]
    raw = tar_layer(files)
    isize = (800 if last == "plausible" else 300) << 10
    layer = _gzip_members(raw, [len(raw) // 2, len(raw) - isize])
    assert len(layer) < MiB and (isize > len(layer)) == (last == "plausible")
    tag = f"models/members-{last}:v1"
    reg.push_model_layers(tag, [ModelLayer(f"{WEIGHT}+gzip", layer)])
    said = "more than its last gzip trailer" if last == "plausible" else "nothing was unpacked"
    _refused_small_whole_big(reg, tmp_path, tag, files, said, len(raw) - isize)


def test_a_gzip_member_that_unpacks_past_its_trailer_is_refused_before_the_disk_fills(
    reg: Registry, tmp_path: Path
) -> None:
    """A gzip layer whose ISIZE trailer was forged to 1 MiB but unpacks to 64 MiB: refused
    as unreadable (the files this process writes are capped at 8 MiB, so staging past
    the trailer would fail with EFBIG instead), nothing published or reserved."""
    import gzip

    raw = tar_layer([("zeros.bin", bytes(64 * MiB))])
    layer = bytearray(gzip.compress(raw, mtime=0))
    layer[-4:] = struct.pack("<I", MiB)
    reg.push_model_layers("models/lying-gz:v1", [ModelLayer(f"{WEIGHT}+gzip", bytes(layer))])
    store = NodeStore(tmp_path / "store", capacity=16 * MiB, high_watermark=1.0)
    with _disk_of(8 * MiB), pytest.raises(UnsupportedMediaType, match="not a readable") as info:
        store.pull(f"oci://{reg.ref('models/lying-gz:v1')}")
    assert "too large" not in str(info.value)
    assert _staged(store) == [] and store.usage().reserved == 0 and store.snapshots() == []
