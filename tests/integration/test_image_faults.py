"""Faults and bad input for the image cache, each against the real registry."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.errors import (
    DigestMismatch,
    ImageDigestMismatch,
    ImageInUse,
    ImageNotFound,
    OriginUnavailable,
    Revoked,
    UnsupportedMediaType,
)
from preheat.images import ImageCache
from preheat.store import NodeStore
from preheat.testing.registry import registry, write_layout

MiB = 1 << 20


def _nothing_published(store: NodeStore) -> None:
    assert ImageCache(store).images() == []
    assert list(store.layout.snapshots.iterdir()) == []


def test_unknown_tag_and_repository_are_named(tmp_path: Path) -> None:
    """An unknown tag and an unknown repository each fail with an error naming it."""
    layout = write_layout(tmp_path / "img", [1000])
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/app:v1")
        cache = ImageCache(NodeStore(tmp_path / "s"))
        with pytest.raises(ImageNotFound, match=r"tag 'nope' not found in repository 'team/app'"):
            cache.pull(reg.ref("team/app:nope"))
        with pytest.raises(ImageNotFound, match=r"repository 'team/ghost' not found"):
            cache.pull(reg.ref("team/ghost:v1"))


def test_digest_mismatches_are_rejected_and_nothing_is_published(tmp_path: Path) -> None:
    """A layer whose bytes changed in the registry, and a manifest whose bytes do not hash
    to its digest, are refused; the store shows nothing of either image."""
    a = write_layout(tmp_path / "a", [256 << 10, 1000], seed=1)
    b = write_layout(tmp_path / "b", [2000], seed=2)
    with registry(tmp_path / "reg") as reg:
        reg.push(a.path, "team/a:v1")
        reg.push(b.path, "team/b:v1")
        layer, size = a.images["linux/amd64"].layers[0]
        data = bytearray(reg.blob_file(layer).read_bytes())
        data[size // 2] ^= 0xFF
        reg.blob_file(layer).write_bytes(bytes(data))
        store = NodeStore(tmp_path / "s")
        with pytest.raises(DigestMismatch, match=layer.removeprefix("sha256:")):
            ImageCache(store).pull(reg.ref("team/a:v1"))
        _nothing_published(store)
        assert not store.layout.blob(layer.removeprefix("sha256:")).exists()
        m = reg.blob_file(b.digest)
        m.write_bytes(m.read_bytes().replace(b'"schemaVersion":2', b'"schemaVersion":2 '))
        with pytest.raises(ImageDigestMismatch, match=f"not {b.digest}"):
            ImageCache(store).pull(reg.ref("team/b:v1"))
        _nothing_published(store)


def test_registry_down_mid_pull_resumes_without_refetching(tmp_path: Path) -> None:
    """The registry dies after the first layer landed; the pull fails, and the next pull
    (registry back) fetches neither that layer nor the ranges of the partial ones again."""
    layout = write_layout(tmp_path / "img", [6 * MiB, 3 * MiB, 1 * MiB])
    # layers fill side by side (first ranges first): the smallest one lands first
    first_layer = layout.images["linux/amd64"].layers[2][0]
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/app:v1")
        store = NodeStore(tmp_path / "s", retries=2, backoff=0.05)
        cache = ImageCache(store)
        errors: list[BaseException] = []

        def pull() -> None:
            try:
                cache.pull(
                    reg.ref("team/app:v1"), connections=1, chunk=256 << 10, rate_limit=4 * MiB
                )
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=pull)
        t.start()
        blob = store.layout.blob(first_layer.removeprefix("sha256:"))
        deadline = time.monotonic() + 30
        while not blob.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert blob.exists(), "the first layer never landed"
        reg.stop(sig=9)
        t.join(60)
        assert errors and isinstance(errors[0], OriginUnavailable), errors
        _nothing_published(store)
        reg.start()
        before = len(reg.requests())
        done = cache.pull(reg.ref("team/app:v1"), chunk=256 << 10)  # the resume unit
        after = reg.requests()[before:]
        assert not [r for r in after if first_layer in r and r.startswith("GET")]
        assert done.bytes_reused >= 1 * MiB
        # what crossed the network before the crash (about 3 MiB) is not fetched again
        assert done.bytes_fetched < layout.images["linux/amd64"].size - 2 * MiB


def test_unsupported_media_type_is_named(tmp_path: Path) -> None:
    """A layer of a media type preheat does not pull fails naming the type."""
    layout = write_layout(
        tmp_path / "img", [1000], layer_media_type="application/vnd.example.weird"
    )
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/odd:v1")
        store = NodeStore(tmp_path / "s")
        with pytest.raises(UnsupportedMediaType, match=r"'application/vnd.example.weird'"):
            ImageCache(store).pull(reg.ref("team/odd:v1"))
        _nothing_published(store)


def test_revoked_layer_removes_images_and_refuses_pulls(tmp_path: Path) -> None:
    """`preheat image revoke LAYER` removes the unreferenced image that has it, keeps a
    referenced one for its endpoint, refuses every new pull until unrevoke."""
    a = write_layout(tmp_path / "a", [200_000, 1000], seed=5)
    b = write_layout(tmp_path / "b", [200_000, 3000], seed=5)  # same base layer
    base = a.images["linux/amd64"].layers[0][0]
    runner = CliRunner()
    with registry(tmp_path / "reg") as reg:
        reg.push(a.path, "team/a:v1")
        reg.push(b.path, "team/b:v1")
        store = NodeStore(tmp_path / "s")
        cache = ImageCache(store)
        cache.pull(reg.ref("team/a:v1"))
        held = cache.pull(reg.ref("team/b:v1"))
        cache.ref(held.digest, "chat")
        out = runner.invoke(
            main,
            ["image", "revoke", base, "--store", str(store.root), "--reason", "CVE-1", "--json"],
        )
        assert out.exit_code == 0, out.output
        rep = json.loads(out.output)
        assert len(rep["removed"]) == 1 and rep["kept"][0]["holders"] == ["image-ref:chat"]
        assert [i.digest for i in cache.images()] == [held.digest]  # kept for its endpoint
        with pytest.raises(ImageInUse):
            cache.rm(held.digest)
        before = len(reg.requests())
        with pytest.raises(Revoked, match=rf"revoked: {base} .*CVE-1"):
            cache.pull(reg.ref("team/a:v1"))
        assert not [r for r in reg.requests()[before:] if "/blobs/" in r]  # nothing fetched
        bad = runner.invoke(
            main, ["image", "pull", reg.ref("team/a:v1"), "--store", str(store.root)]
        )
        assert bad.exit_code == 1 and "revoked" in bad.output
        assert (
            runner.invoke(main, ["image", "unrevoke", base, "--store", str(store.root)]).exit_code
            == 0
        )
        assert cache.pull(reg.ref("team/a:v1")).layers == 2


def test_cache_pull_refuses_a_revoked_revision(tmp_path: Path) -> None:
    """A model revision on the revocation list is removed and `cache pull` refuses it."""
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x" * 5000)
    store = NodeStore(tmp_path / "s")
    first = store.pull(f"file://{src}")
    from preheat.store.revoke import revoke, unrevoke

    rep = revoke(store._db, store._space, first.revision, "withdrawn")
    assert rep.removed == (first.manifest_digest,)
    assert not first.snapshot.exists()
    runner = CliRunner()
    out = runner.invoke(main, ["cache", "pull", f"file://{src}", "--store", str(store.root)])
    assert out.exit_code == 1 and "revoked" in out.output and "withdrawn" in out.output
    assert unrevoke(store._db, first.revision)
    assert store.pull(f"file://{src}").manifest_digest == first.manifest_digest


def test_registry_back_within_the_backoff_is_retried(tmp_path: Path) -> None:
    """A registry that is down when the pull starts and back within the retries' backoff
    is waited for: the pull succeeds (manifest requests retry 5xx, resets, refusals)."""
    layout = write_layout(tmp_path / "img", [100_000])
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/app:v1")
        reg.stop(sig=9)
        store = NodeStore(tmp_path / "s", retries=6, backoff=0.25)  # waits up to ~8 s
        restart = threading.Timer(0.5, reg.start)
        restart.start()
        try:
            pulled = ImageCache(store).pull(reg.ref("team/app:v1"))
        finally:
            restart.join(30)
        assert pulled.digest == layout.digest
