"""Ranged reads are pinned to what ``resolve`` saw: an origin changed mid-fill is refused.

Each origin kind (nginx, an HTTP server that ignores conditional headers, moto S3, a local
directory) has its file replaced while a pull is in flight; the pull must fail with
``OriginChanged`` instead of publishing a blob of mixed old and new bytes, and the next
pull must fetch the new bytes cleanly. The swap happens from the pull's progress callback
(on the event loop, once some bytes arrived and before the last), so it is mid-fill by
construction, not by timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from preheat.artifacts.refs import parse_ref
from preheat.errors import OriginChanged
from preheat.sources.base import Location, Source, open_source
from preheat.store import NodeStore
from preheat.testing.origins import AppInThread, S3Origin, nginx_origin, s3_origin

KiB = 1 << 10
MiB = 1 << 20
SECRET_URL = "http://user:pw@127.0.0.1:{port}/{name}?X-Amz-Signature=secret"


def _bytes(seed: int, size: int) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * (64 * KiB // 32)
    return (block * (size // len(block) + 1))[:size]


def _store(tmp_path: Path) -> NodeStore:
    return NodeStore(tmp_path / "store", retries=1, backoff=0.01)


def _assert_nothing_published(store: NodeStore) -> None:
    assert list(store.layout.blobs.glob("??/*")) == []
    assert list(store.layout.snapshots.iterdir()) == []
    assert store.snapshots() == []
    assert list(store.layout.tmp.glob("*.part")) == []  # the mixed partial is gone too


class SwapMidFill:
    """A pull progress callback that changes the origin once, mid-fill."""

    def __init__(self, swap: Callable[[], None]) -> None:
        self.swap = swap
        self.fired_at: tuple[int, int] | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.fired_at is None and 0 < done < total:
            self.fired_at = (done, total)
            self.swap()


def _replace_file(path: Path, data: bytes, *, mtime_step_s: int = 7) -> Callable[[], None]:
    """``os.replace`` ``path`` with ``data``, staged beforehand outside the origin's tree.

    The new file's mtime is moved by whole seconds: nginx derives its ETag from mtime in
    seconds and size, so a same-size replace within one second is invisible to HTTP.
    """
    new = path.parent.parent / f"{path.name}.new"
    new.write_bytes(data)
    st = path.stat()
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns + mtime_step_s * 10**9))

    def swap() -> None:
        os.replace(new, path)

    return swap


# --- HTTP: nginx ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["aiohttp", "splice"])
def test_http_file_replaced_mid_fill_is_refused(tmp_path: Path, path: str) -> None:
    """A same-size replace mid-fill is OriginChanged on both fetch paths; nothing is
    published, the message is redacted, and the next pull fetches the new bytes."""
    root = tmp_path / "origin"
    root.mkdir()
    old, new = _bytes(1, 24 * MiB), _bytes(2, 24 * MiB)
    (root / "w.bin").write_bytes(old)
    swap = SwapMidFill(_replace_file(root / "w.bin", new))
    store = _store(tmp_path)
    # aiohttp: the client-side rate limit slows it; splice: nginx's per-connection limit
    # (ranges of several MiB, so the limit bites beyond the socket buffers)
    kw: dict[str, Any] = (
        {"rate_limit": 6e6, "chunk": 1 * MiB} if path == "aiohttp" else {"chunk": 6 * MiB}
    )
    with nginx_origin(root, limit_rate=None if path == "aiohttp" else 4_000_000) as o:
        url = SECRET_URL.format(port=o.port, name="w.bin")
        revision, _ = store.resolve(url)
        with pytest.raises(OriginChanged) as err:
            store.pull(url, connections=2, progress=swap, **kw)
        assert swap.fired_at is not None
        msg = str(err.value)
        assert "w.bin" in msg and "changed" in msg
        assert "pw" not in msg and "secret" not in msg
        _assert_nothing_published(store)
        again = store.pull(url, connections=2, chunk=kw["chunk"])
    assert again.revision != revision
    assert (again.snapshot / "w.bin").read_bytes() == new


# --- HTTP: an origin that ignores If-Match ---------------------------------------------------


class CarelessOrigin(AppInThread):
    """A file server that ignores every conditional header.

    ETag is the sha256 of the current bytes. ``whole=True`` answers ranged GETs with 200
    and the whole body (what an ``If-Range`` request gets once the file changed)."""

    def __init__(self, root: Path, *, whole: bool = False) -> None:
        super().__init__(self._handle)
        self.root = root
        self.whole = whole

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = self.root / request.match_info["path"]
        if not path.is_file():
            return web.Response(status=404)
        data = path.read_bytes()
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()[:16]}"'}
        rng = request.headers.get("Range", "")
        if request.method == "HEAD" or not rng or self.whole:
            return web.Response(body=data, headers=headers)  # aiohttp sends no body to HEAD
        a, b = rng.removeprefix("bytes=").split("-")
        start, end = int(a), int(b) + 1
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        return web.Response(status=206, body=data[start:end], headers=headers)


async def _read_range(
    source: Source, loc: Location, how: str, start: int, end: int, fd: int
) -> int:
    """Read ``[start, end)`` through ``fetch`` or ``fetch_to_fd``; returns bytes landed."""
    got = 0
    if how == "fetch_to_fd":

        def landed(offset: int, n: int) -> None:
            nonlocal got
            got += n

        await source.fetch_to_fd(loc, start, end, fd, landed)  # type: ignore[attr-defined]
        return got
    async with contextlib.aclosing(source.fetch(loc, start, end)) as stream:
        async for data in stream:
            os.pwrite(fd, data, start + got)
            got += len(data)
    return got


async def _resolve_change_read(
    ref: str, change: Callable[[], None], how: str, out: Path, **kw: Any
) -> int:
    """Resolve ``ref``, read its first range, ``change()`` the origin, read the second."""
    source = open_source(parse_ref(ref), **kw)
    try:
        res = await source.resolve()
        (loc,) = res.locations.values()
        fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            assert await _read_range(source, loc, how, 0, 64 * KiB, fd) == 64 * KiB
            change()
            return await _read_range(source, loc, how, 64 * KiB, 128 * KiB, fd)
        finally:
            os.close(fd)
    finally:
        await source.aclose()


@pytest.mark.parametrize("whole", [False, True], ids=["206", "200-whole-body"])
@pytest.mark.parametrize("how", ["fetch", "fetch_to_fd"])
def test_http_origin_ignoring_if_match_is_caught(tmp_path: Path, how: str, whole: bool) -> None:
    """A server that ignores If-Match and serves the new file (as 206, or as 200 with the
    whole new body, like an If-Range answer) is caught by its changed ETag on both paths."""
    root = tmp_path / "origin"
    root.mkdir()
    (root / "w.bin").write_bytes(_bytes(1, 1 * MiB))
    swap = _replace_file(root / "w.bin", _bytes(2, 1 * MiB))
    with CarelessOrigin(root) as o:
        url = SECRET_URL.format(port=o.port, name="w.bin")

        def change() -> None:
            swap()
            o.whole = whole

        with pytest.raises(OriginChanged, match="ETag") as err:
            asyncio.run(_resolve_change_read(url, change, how, tmp_path / "out"))
    assert "pw" not in str(err.value) and "secret" not in str(err.value)


def test_http_unchanged_origin_reads_both_paths(tmp_path: Path) -> None:
    """Control: with no change, both paths read both ranges from the same careless origin."""
    root = tmp_path / "origin"
    root.mkdir()
    (root / "w.bin").write_bytes(_bytes(1, 1 * MiB))
    with CarelessOrigin(root) as o:
        url = f"http://127.0.0.1:{o.port}/w.bin"
        for how in ("fetch", "fetch_to_fd"):
            assert asyncio.run(_resolve_change_read(url, lambda: None, how, tmp_path / how)) == (
                64 * KiB
            )


# --- S3 (moto) ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Origin]:
    with s3_origin() as origin:
        yield origin


@pytest.mark.parametrize("versioned", [False, True], ids=["etag", "version-id"])
def test_s3_object_overwritten_mid_fill(tmp_path: Path, s3: S3Origin, versioned: bool) -> None:
    """Unversioned: an overwrite mid-fill is OriginChanged (IfMatch on the ETag), nothing is
    published, the next pull gets the new bytes. Versioned: the fill keeps reading the
    version it resolved and publishes exactly those bytes."""
    bucket = "cond-versioned" if versioned else "cond-plain"
    c = s3.client()
    c.create_bucket(Bucket=bucket)
    if versioned:
        c.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    old, new = _bytes(3, 6 * MiB), _bytes(4, 6 * MiB)
    c.put_object(Bucket=bucket, Key="m/w.bin", Body=old)
    swap = SwapMidFill(lambda: c.put_object(Bucket=bucket, Key="m/w.bin", Body=new))
    store = _store(tmp_path)
    ref = f"s3://{bucket}/m"
    kw: dict[str, Any] = {"endpoint_url": s3.endpoint_url, "chunk": 256 * KiB, "connections": 2}
    revision, _ = store.resolve(ref, endpoint_url=s3.endpoint_url)
    if versioned:
        r = store.pull(ref, progress=swap, rate_limit=3e6, **kw)
        assert swap.fired_at is not None
        assert r.revision == revision
        assert (r.snapshot / "w.bin").read_bytes() == old
    else:
        with pytest.raises(OriginChanged, match=r"w\.bin") as err:
            store.pull(ref, progress=swap, rate_limit=3e6, **kw)
        assert swap.fired_at is not None
        assert "412" in str(err.value) or "ETag" in str(err.value)
        _assert_nothing_published(store)
    again = store.pull(ref, **kw)
    assert again.revision != revision
    assert (again.snapshot / "w.bin").read_bytes() == new


# --- file:// ----------------------------------------------------------------------------------


def _file_change(path: Path, kind: str) -> Callable[[], None]:
    """A change of ``path`` to make later; what it needs is staged outside the tree."""
    if kind == "replace":  # same size and mtime: only the inode tells
        return _replace_file(path, _bytes(6, path.stat().st_size), mtime_step_s=0)
    if kind == "symlink":
        target = path.parent.parent / "elsewhere.bin"
        target.write_bytes(_bytes(7, path.stat().st_size))
        link = path.parent.parent / f"{path.name}.lnk"
        link.symlink_to(target)
        return lambda: os.replace(link, path)
    st = path.stat()  # written "a while ago", so the rewrite's mtime surely differs
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 10 * 10**9))

    def rewrite() -> None:  # in place: same inode and size, new bytes and mtime
        with open(path, "r+b") as f:
            f.write(_bytes(8, 64 * KiB))

    return rewrite


@pytest.mark.parametrize("kind", ["replace", "symlink", "rewrite"])
@pytest.mark.parametrize("how", ["fetch", "fetch_to_fd"])
def test_file_source_changed_between_ranges(tmp_path: Path, how: str, kind: str) -> None:
    """A file replaced, swapped for a symbolic link or rewritten in place after resolve is
    refused by the next range on both read paths (O_NOFOLLOW, inode/size/mtime of the fd)."""
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(_bytes(5, 1 * MiB))
    change = _file_change(src / "w.bin", kind)
    match = "symbolic link" if kind == "symlink" else "changed"
    with pytest.raises(OriginChanged, match=match):
        asyncio.run(_resolve_change_read(f"file://{src / 'w.bin'}", change, how, tmp_path / "o"))


@pytest.mark.parametrize("kind", ["replace", "symlink", "rewrite"])
def test_file_source_changed_mid_copy_then_fresh_pull(tmp_path: Path, kind: str) -> None:
    """A pull whose directory source changes mid-copy fails with OriginChanged and
    publishes nothing; once the tree is a plain file again, a fresh pull gets its bytes."""
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(_bytes(5, 8 * MiB))
    swap = SwapMidFill(_file_change(src / "w.bin", kind))
    store = _store(tmp_path)
    ref = f"file://{src}"
    with pytest.raises(OriginChanged, match=r"w\.bin"):
        store.pull(ref, progress=swap, rate_limit=6e6, chunk=256 * KiB, connections=2)
    assert swap.fired_at is not None
    _assert_nothing_published(store)
    if kind == "symlink":  # links stay refused; put a real file back
        (src / "w.bin").unlink()
        (src / "w.bin").write_bytes(_bytes(9, 8 * MiB))
    want = (src / "w.bin").read_bytes()
    r = store.pull(ref)
    assert (r.snapshot / "w.bin").read_bytes() == want
