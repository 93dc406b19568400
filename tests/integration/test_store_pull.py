"""NodeStore pulls from a real nginx and real directories: dedup, re-pull, faults."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.bench.models import generate_model, rewrite_shard, write_http_manifest
from preheat.errors import (
    DigestMismatch,
    InsufficientSpace,
    ObjectNotFound,
    OriginUnavailable,
    RevisionChanged,
    SnapshotInUse,
    TruncatedBody,
    UnsafePath,
)
from preheat.store import NodeStore
from preheat.testing.origins import HttpOrigin, free_port, nginx_origin

MiB = 1 << 20


@pytest.fixture(scope="module")
def origin_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("origin")
    generate_model(root / "m", 24 * MiB, 8, seed=1)
    write_http_manifest(root / "m")
    generate_model(root / "big", 40 * MiB, 2, seed=2)
    write_http_manifest(root / "big")
    return root


@pytest.fixture(scope="module")
def nginx(origin_root: Path) -> Iterator[HttpOrigin]:
    with nginx_origin(origin_root) as o:
        yield o


def _store(tmp_path: Path, **kw: object) -> NodeStore:
    return NodeStore(tmp_path / "store", retries=1, backoff=0.01, **kw)  # type: ignore[arg-type]


def _tree(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url) as r:
        return bytes(r.read())


def _store_state(store: NodeStore) -> tuple[list[str], list[str], list[str]]:
    return (
        sorted(p.name for p in store.layout.snapshots.iterdir()),
        sorted(p.name for p in store.layout.blobs.glob("??/*")),
        [s.digest for s in store.snapshots()],
    )


def test_pull_http_manifest_verified_and_repull_is_free(
    tmp_path: Path, nginx: HttpOrigin, origin_root: Path
) -> None:
    """A pull reproduces the origin's files; pulling again fetches nothing, in well under 1 s."""
    store = _store(tmp_path)
    url = nginx.url("m/preheat-manifest.json")
    r = store.pull(url, chunk=1 * MiB)
    src = _tree(origin_root / "m")
    src.pop("preheat-manifest.json")
    assert _tree(r.snapshot) == src
    total = sum((origin_root / "m" / p).stat().st_size for p in src)
    assert r.bytes_fetched == total and r.bytes_reused == 0
    assert r.snapshot == store.layout.snapshot(r.manifest_digest)
    assert store.has(r.manifest_digest) and store.has(r.revision)
    # snapshot files are hard links to read-only blobs
    f = next(r.snapshot.glob("*.safetensors"))
    assert f.stat().st_nlink == 2 and f.stat().st_mode & 0o222 == 0
    again = store.pull(url)
    assert again.bytes_fetched == 0 and again.bytes_reused == total
    assert again.manifest_digest == r.manifest_digest and again.seconds < 1.0
    latest = json.loads(
        (store.layout.refs / next(store.layout.refs.iterdir()) / "latest").read_text()
    )
    assert latest["revision"] == r.revision and latest["manifest_digest"] == r.manifest_digest


def test_new_revision_fetches_only_the_changed_shard(tmp_path: Path, origin_root: Path) -> None:
    """Changing 1 of 8 shards makes a new revision that moves exactly that shard's bytes."""
    src = tmp_path / "origin"
    shutil.copytree(origin_root / "m", src / "m")
    store = _store(tmp_path)
    with nginx_origin(src) as o:
        url = o.url("m/preheat-manifest.json")
        v1 = store.pull(url)
        changed = rewrite_shard(src / "m", 5, seed=9)
        write_http_manifest(src / "m")
        v2 = store.pull(url)
    assert v2.revision != v1.revision and v2.manifest_digest != v1.manifest_digest
    with nginx_origin(src) as o, pytest.raises(RevisionChanged, match=v1.revision):
        store.pull(o.url("m/preheat-manifest.json"), revision=v1.revision)  # pinned: refused
    assert v2.bytes_fetched == changed.stat().st_size
    shared = [p.name for p in (src / "m").glob("*.safetensors") if p != changed]
    for name in shared:  # unchanged shards are the same inode in both snapshots
        assert (v1.snapshot / name).stat().st_ino == (v2.snapshot / name).stat().st_ino
    assert (v1.snapshot / changed.name).read_bytes() != (v2.snapshot / changed.name).read_bytes()


def test_pull_single_file_url(tmp_path: Path, nginx: HttpOrigin, origin_root: Path) -> None:
    """A plain file URL (no manifest) is fetched in ranges and hashed while fetching."""
    store = _store(tmp_path)
    name = "model-00001-of-00002.safetensors"
    r = store.pull(nginx.url(f"big/{name}"), chunk=1 * MiB, connections=4)
    want = hashlib.sha256((origin_root / "big" / name).read_bytes()).hexdigest()
    assert store.manifest(r.manifest_digest).files[0].sha256 == want
    assert r.revision.startswith("http:")
    assert store.pull(nginx.url(f"big/{name}")).bytes_fetched == 0


@pytest.mark.parametrize("rate_limit", [None, 1e12])
def test_pull_file_tree_and_unchanged_files_not_recopied(
    tmp_path: Path, origin_root: Path, rate_limit: float | None
) -> None:
    """file:// trees are copied and hashed; after touching one file only that file is copied.

    Without a rate limit the copy runs in the kernel (copy_file_range); with one, through
    Python reads."""
    src = tmp_path / "src"
    shutil.copytree(origin_root / "m", src)
    store = _store(tmp_path)
    r1 = store.pull(f"file://{src}", rate_limit=rate_limit, chunk=1 * MiB)
    assert _tree(r1.snapshot) == _tree(src)
    (src / "config.json").write_text('{"changed": true}')
    r2 = store.pull(f"file://{src}")
    assert r2.revision != r1.revision
    assert r2.bytes_fetched == (src / "config.json").stat().st_size


def test_symlink_in_file_source_rejected(tmp_path: Path) -> None:
    """A link inside a file:// tree is refused before anything is fetched."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.bin").write_bytes(b"x" * 10)
    (src / "evil").symlink_to("/etc/passwd")
    store = _store(tmp_path)
    with pytest.raises(UnsafePath, match="evil"):
        store.pull(f"file://{src}")
    assert _store_state(store) == ([], [], [])


def test_manifest_with_traversal_rejected(tmp_path: Path) -> None:
    """A served manifest naming '../' is refused; nothing is fetched or published."""
    root = tmp_path / "o"
    (root / "m").mkdir(parents=True)
    (root / "secret").write_bytes(b"s")
    doc = {"files": [{"path": "../secret", "size": 1, "sha256": hashlib.sha256(b"s").hexdigest()}]}
    (root / "m" / "preheat-manifest.json").write_text(json.dumps(doc))
    store = _store(tmp_path)
    with nginx_origin(root) as o, pytest.raises(UnsafePath, match=r"\.\./secret"):
        store.pull(o.url("m/preheat-manifest.json"))
    assert _store_state(store) == ([], [], [])


def test_digest_mismatch_publishes_nothing(tmp_path: Path, origin_root: Path) -> None:
    """Bytes that do not match the manifest raise DigestMismatch naming file and both digests."""
    src = tmp_path / "o" / "m"
    shutil.copytree(origin_root / "m", src)
    victim = src / "model-00003-of-00008.safetensors"
    listed = json.loads((src / "preheat-manifest.json").read_text())
    expected = next(f["sha256"] for f in listed["files"] if f["path"] == victim.name)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte differs
    victim.write_bytes(bytes(data))
    actual = hashlib.sha256(data).hexdigest()
    store = _store(tmp_path)
    with nginx_origin(tmp_path / "o") as o, pytest.raises(DigestMismatch) as ei:
        store.pull(o.url("m/preheat-manifest.json"), chunk=1 * MiB)
    msg = str(ei.value)
    assert victim.name in msg and expected in msg and actual in msg
    assert ei.value.expected == expected and ei.value.actual == actual
    snaps, blobs, rows = _store_state(store)
    assert snaps == [] and rows == [] and actual not in blobs and expected not in blobs
    # the bad bytes are gone; other files' partial downloads stay for a later resume
    assert not (store.layout.tmp / f"{expected}.part").exists()


def test_not_enough_space_refused_before_download(tmp_path: Path, nginx: HttpOrigin) -> None:
    """A model bigger than capacity x watermark is refused up front, with the numbers."""
    store = _store(tmp_path, capacity=20 * MiB, high_watermark=0.9)
    with pytest.raises(InsufficientSpace) as ei:
        store.pull(nginx.url("m/preheat-manifest.json"))
    msg = str(ei.value)
    total = json.loads(_get(nginx.url("m/preheat-manifest.json")))["files"]
    need = sum(f["size"] for f in total)
    assert f"({need} bytes)" in msg and "18.0 MiB is free" in msg and "capacity 20.0 MiB" in msg
    assert ei.value.need == need and ei.value.free == 18 * MiB
    assert _store_state(store) == ([], [], [])
    assert not list(store.layout.tmp.glob("*.part"))


def test_eviction_makes_room_but_never_takes_leased_or_pinned(
    tmp_path: Path, nginx: HttpOrigin
) -> None:
    """With room for one model, pulling another evicts the first unless it is leased or pinned."""
    store = _store(tmp_path, capacity=50 * MiB, high_watermark=0.9)  # 45 MiB usable
    a = store.pull(nginx.url("m/preheat-manifest.json"))  # 24 MiB
    store.lease(a.manifest_digest, "replica-1")
    with pytest.raises(InsufficientSpace, match="evicting every unpinned, unleased"):
        store.pull(nginx.url("big/preheat-manifest.json"))  # 40 MiB
    assert store.has(a.manifest_digest)
    with pytest.raises(SnapshotInUse, match="replica-1"):
        store.delete(a.manifest_digest)
    # a lease survives across NodeStore instances (it lives in sqlite)
    assert NodeStore(store.root).leases(a.manifest_digest) == ["replica-1"]
    store.lease(a.manifest_digest, "replica-2")
    assert store.release(a.manifest_digest, "replica-1")
    assert not store.release(a.manifest_digest, "replica-1")
    assert store.release_holder("replica-2") == 1 and store.leases(a.manifest_digest) == []
    store.pin(a.manifest_digest)
    with pytest.raises(InsufficientSpace):
        store.pull(nginx.url("big/preheat-manifest.json"))
    store.unpin(a.manifest_digest)
    b = store.pull(nginx.url("big/preheat-manifest.json"))
    assert not store.has(a.manifest_digest) and store.has(b.manifest_digest)
    assert not store.layout.snapshot(a.manifest_digest).exists()
    assert store.usage().used == b.bytes_fetched


def test_origin_unreachable(tmp_path: Path) -> None:
    """Nothing listening: OriginUnavailable naming the URL; the store is unchanged."""
    store = _store(tmp_path)
    url = f"http://127.0.0.1:{free_port()}/m/preheat-manifest.json"
    with pytest.raises(OriginUnavailable, match=r"127\.0\.0\.1"):
        store.pull(url)
    assert _store_state(store) == ([], [], [])


def test_origin_404(tmp_path: Path, nginx: HttpOrigin) -> None:
    """A missing manifest is ObjectNotFound with the status; the store is unchanged."""
    store = _store(tmp_path)
    with pytest.raises(ObjectNotFound, match="404"):
        store.pull(nginx.url("nope/preheat-manifest.json"))
    assert _store_state(store) == ([], [], [])


def test_truncated_body(tmp_path: Path, origin_root: Path) -> None:
    """A file shorter than the manifest says fails as TruncatedBody; nothing is published."""
    src = tmp_path / "o" / "m"
    shutil.copytree(origin_root / "m", src)
    shard = src / "model-00002-of-00008.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    store = _store(tmp_path)
    with nginx_origin(tmp_path / "o") as o, pytest.raises(TruncatedBody, match=shard.name):
        store.pull(o.url("m/preheat-manifest.json"))
    snaps, _, rows = _store_state(store)
    assert snaps == [] and rows == []


def test_verify_quarantines_corrupt_blob_and_refetches_it(
    tmp_path: Path, nginx: HttpOrigin
) -> None:
    """verify finds a flipped byte, quarantines the bad file and fetches the blob again."""
    store = _store(tmp_path)
    url = nginx.url("m/preheat-manifest.json")
    r = store.pull(url)
    assert store.verify().ok
    blob = next(iter(sorted(store.layout.blobs.glob("??/*"), key=lambda p: -p.stat().st_size)))
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    rep = store.verify()
    assert not rep.ok and rep.corrupt[0][0] == blob.name
    assert rep.removed_snapshots == () and rep.repairs[0].repaired
    assert list(store.layout.quarantine.iterdir()) and blob.exists()
    assert store.pull(url).bytes_fetched == 0 and store.has(r.manifest_digest)
    assert store.verify().ok


def test_clean_tmp_keeps_partials_in_use(tmp_path: Path) -> None:
    """Old work dirs and abandoned partials go; a partial whose lock is held stays."""
    import fcntl

    store = _store(tmp_path)
    tmp = store.layout.tmp
    (tmp / "snap-old").mkdir()
    for name in ("a", "b"):
        (tmp / f"{name}.part").write_bytes(b"x")
        (tmp / f"{name}.json").write_text("{}")
    for p in tmp.iterdir():
        os.utime(p, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    fd = os.open(tmp / "b.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert store.clean_tmp() == 2
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp.iterdir()) == ["a.lock", "b.json", "b.lock", "b.part"]


def test_delete_removes_only_unshared_blobs(tmp_path: Path, origin_root: Path) -> None:
    """Deleting one of two revisions keeps the blobs the other still uses."""
    src = tmp_path / "o" / "m"
    shutil.copytree(origin_root / "m", src)
    store = _store(tmp_path)
    with nginx_origin(tmp_path / "o") as o:
        url = o.url("m/preheat-manifest.json")
        v1 = store.pull(url)
        changed = rewrite_shard(src, 0, seed=3)
        write_http_manifest(src)
        v2 = store.pull(url)
    done = store.delete(v1.manifest_digest)
    assert done.snapshots == (v1.manifest_digest,) and len(done.blobs) == 1
    assert _tree(v2.snapshot)[changed.name] == hashlib.sha256(changed.read_bytes()).hexdigest()
    assert store.verify().ok


def test_origin_without_range_support(tmp_path: Path, origin_root: Path) -> None:
    """An origin that ignores Range (python -m http.server) still works: one stream per file."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=origin_root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/m/preheat-manifest.json"
        deadline = time.monotonic() + 10
        while True:
            try:
                _get(url)
                break
            except OSError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.05)
        store = _store(tmp_path)
        r = store.pull(url, chunk=1 * MiB)
        src = _tree(origin_root / "m")
        src.pop("preheat-manifest.json")
        assert _tree(r.snapshot) == src
    finally:
        proc.terminate()
        proc.wait(10)


def test_rate_limit_caps_throughput(tmp_path: Path, nginx: HttpOrigin) -> None:
    """rate_limit bounds bytes/s over all connections (the local fleet's remote origin)."""
    store = _store(tmp_path)
    t0 = time.monotonic()
    r = store.pull(nginx.url("m/preheat-manifest.json"), rate_limit=40 * MiB, chunk=1 * MiB)
    elapsed = time.monotonic() - t0
    assert elapsed >= (r.bytes_fetched - 4 * MiB) / (40 * MiB)
