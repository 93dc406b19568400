"""Parallel, verified, resumable fetch of one blob into the store's ``tmp/``.

How one file is fetched (``fetch_blob``):

- The file is cut into ``chunk``-sized ranges; each range is one ranged request holding
  one of the pull's connection slots (an ``asyncio.Semaphore`` shared by all files), so
  a single big file uses every connection and many small files share them.
- Bytes land at their offsets in ``tmp/<key>.part``: moved by the kernel where the source
  offers a direct path (splice for http://, copy_file_range for file://), else ``os.pwrite``.
- Hashing overlaps the download: a thread follows the *contiguous* written prefix and
  hashes it through a read-only mmap (no copy), so ranges may finish in any order.
- Each finished range is handed to the kernel for writeback at once
  (``sync_file_range``), so the final ``fsync`` before publishing finds little to do.
- Every finished range is recorded in ``tmp/<key>.json``; after a crash the next fill
  skips those ranges (the hash is recomputed from the bytes on disk).
- A failed range (5xx, reset, truncated body) is retried with exponential backoff from
  the byte where it stopped; 404 is not retried.
- Every range is conditional on the validator ``resolve`` saw (the source's job, see
  ``sources/base.py``): a file that changed at the origin mid-fill raises
  ``OriginChanged``, which is not retried; its partial file and state are deleted (they
  hold bytes of a revision that no longer exists), so nothing of it is published.
- On success the digest is compared with the manifest's; a mismatch deletes the partial
  file and raises ``DigestMismatch`` naming the file, expected and actual digest. A match
  is fsynced, made read-only and published with ``os.replace`` into ``blobs/``.

Correctness never depends on the per-blob lock: the lock only makes two pullers of the
same blob fetch it once; a published blob is always a complete, verified file.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import hashlib
import heapq
import json
import mmap
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preheat.artifacts.refs import redact_url
from preheat.config import format_size
from preheat.errors import (
    DigestMismatch,
    InsufficientSpace,
    ObjectNotFound,
    OriginChanged,
    OriginUnavailable,
    RangeNotSupported,
    TruncatedBody,
)
from preheat.sources.base import Location, Source, Unsupported
from preheat.store.layout import Layout

DEFAULT_CHUNK = 32 << 20
_HASH_READ = 8 << 20
RETRYABLE: tuple[type[BaseException], ...] = (OriginUnavailable, TruncatedBody, TimeoutError)
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # a filled disk, not a failed origin

_libc = None
with contextlib.suppress(OSError, AttributeError):
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range back to disk without waiting (Linux)."""
    if _libc is not None:
        _libc.sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE


@dataclass
class FillStats:
    """Byte counters of one pull, updated from the event loop thread."""

    total: int = 0
    fetched: int = 0
    resumed: int = 0
    reused: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> int:
        return self.fetched + self.resumed + self.reused


class RateLimiter:
    """A token bucket over every connection of a pull: at most ``rate`` bytes/s on average."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate limit {rate} must be > 0 bytes/s")
        self.rate = rate
        self.burst = burst if burst is not None else max(rate * 0.1, 1 << 20)
        self._next = 0.0

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self._next = max(self._next, now - self.burst / self.rate) + n / self.rate
        delay = self._next - now
        if delay > 0:
            await asyncio.sleep(delay)


class _Progress:
    """Thread-safe bookkeeping of one partial file: bytes written per range, and the
    contiguous prefix the hasher may read."""

    def __init__(self, size: int, chunk: int, done: set[int]) -> None:
        self.size = size
        self.chunk = chunk
        self.n = max(1, -(-size // chunk))
        self.filled = [self.length(i) if i in done else 0 for i in range(self.n)]
        self.cond = threading.Condition()
        self.first = 0
        self.cancelled = False
        self.writebacks: list[asyncio.Future[None]] = []
        self._advance_first()

    def length(self, i: int) -> int:
        return min(self.size, (i + 1) * self.chunk) - i * self.chunk

    def _advance_first(self) -> None:
        while self.first < self.n and self.filled[self.first] >= self.length(self.first):
            self.first += 1

    @property
    def watermark(self) -> int:
        if self.first >= self.n:
            return self.size
        return self.first * self.chunk + self.filled[self.first]

    def wrote(self, i: int, n: int) -> None:
        self.filled[i] += n
        if i == self.first:
            with self.cond:
                self._advance_first()
                self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()

    def hash_following(self, fd: int) -> str | None:
        """Runs in a thread: sha256 of the file as its contiguous prefix grows.

        Reads through a read-only mmap of the file, so hashing costs no copy out of the
        page cache (hashlib releases the GIL on large buffers)."""
        h = hashlib.sha256()
        if self.size == 0:
            return h.hexdigest()
        mm = mmap.mmap(fd, self.size, prot=mmap.PROT_READ)
        with contextlib.suppress(OSError, AttributeError):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        view = memoryview(mm)
        try:
            pos = 0
            while pos < self.size:
                with self.cond:
                    while self.watermark <= pos and not self.cancelled:
                        self.cond.wait(0.25)
                    if self.cancelled:
                        return None
                    wm = self.watermark
                while pos < wm:
                    n = min(_HASH_READ, wm - pos)
                    h.update(view[pos : pos + n])
                    pos += n
            return h.hexdigest()
        finally:
            view.release()
            mm.close()


class Slots:
    """A counting semaphore whose waiters are served lowest ``priority`` first.

    Ranges ask with priority (range index, file sequence): the first ranges of every file
    in flight go before the later ranges of any, so several files fill side by side and
    their hash threads work in parallel instead of one after another."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: list[tuple[tuple[int, int], int, asyncio.Future[None]]] = []
        self._seq = 0

    async def acquire(self, priority: tuple[int, int]) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._waiters, (priority, self._seq, fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # we were handed a slot as we got cancelled
            else:
                self._waiters = [w for w in self._waiters if w[2] is not fut]
                heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    @contextlib.asynccontextmanager
    async def slot(self, priority: tuple[int, int]) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()


async def lock_file(path: Path, poll: float = 0.05) -> int:
    """Take an exclusive ``flock`` on ``path`` (created if missing) without blocking the loop."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                await asyncio.sleep(poll)
    except BaseException:
        os.close(fd)
        raise


def unlock_file(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _load_state(path: Path, size: int, chunk: int, fingerprint: str) -> set[int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    if data.get("size") != size or data.get("chunk") != chunk or data.get("fp") != fingerprint:
        return set()
    return {int(i) for i in data.get("done", [])}


def _save_state(path: Path, size: int, chunk: int, fingerprint: str, done: set[int]) -> None:
    # unique per call: ranges finish in threads at once (an older list winning only means
    # a resume fetches a range again)
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.new")
    tmp.write_text(
        json.dumps({"size": size, "chunk": chunk, "fp": fingerprint, "done": sorted(done)})
    )
    os.replace(tmp, path)


@dataclass
class FillContext:
    """What every blob fetch of one pull shares."""

    source: Source
    layout: Layout
    connections: Slots
    executor: Executor
    stats: FillStats
    limiter: RateLimiter | None = None
    fsync: bool = True
    chunk: int = DEFAULT_CHUNK
    retries: int = 5
    backoff: float = 0.2
    on_bytes: Callable[[int], None] | None = None
    direct: bool = True  # use a source's zero-copy fetch_to_fd when it offers one
    dirty_dirs: set[Path] = field(default_factory=set)  # to fsync before the snapshot commit
    #: ``sources.peer.PeerFill``: ranges of blobs with a sha256 come from peers first.
    peers: Any = None
    #: The cluster-wide origin budget's token bucket (bytes from the origin only).
    origin_limiter: RateLimiter | None = None


async def fetch_blob(
    ctx: FillContext,
    path: str,
    location: Location,
    size: int,
    expected: str | None,
    key: str,
    seq: int = 0,
) -> str:
    """Fetch one file into ``tmp/<key>.part``, verify and publish it; returns its sha256.

    The caller holds the per-``key`` lock. A full disk (while writing, saving the resume
    state or at the final fsync, where delayed allocation reports it) is
    ``InsufficientSpace``, and the partial file is removed to give the space back.
    """
    try:
        return await _fetch_blob(ctx, path, location, size, expected, key, seq)
    except DigestMismatch:
        if ctx.peers is not None and expected is not None:
            ctx.peers.blob_failed(expected)
        raise
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
        _discard(ctx.layout.tmp / f"{key}.part", ctx.layout.tmp / f"{key}.json")
        raise _disk_full(ctx, location, None, exc) from exc
    finally:
        if ctx.peers is not None:
            ctx.peers.blob_done(expected)


async def _fetch_blob(
    ctx: FillContext,
    path: str,
    location: Location,
    size: int,
    expected: str | None,
    key: str,
    seq: int,
) -> str:
    loop = asyncio.get_running_loop()
    part = ctx.layout.tmp / f"{key}.part"
    state = ctx.layout.tmp / f"{key}.json"
    chunk = ctx.chunk
    done = _load_state(state, size, chunk, location.fingerprint) if part.exists() else set()
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            if not done:
                os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
            prog = _Progress(size, chunk, done)
            resumed = sum(prog.length(i) for i in done)
            ctx.stats.resumed += resumed
            hasher = loop.run_in_executor(ctx.executor, prog.hash_following, fd)
            try:
                async with asyncio.TaskGroup() as tg:
                    for i in range(prog.n):
                        if i not in done:
                            tg.create_task(
                                _fetch_range(ctx, prog, fd, location, i, state, done, seq, expected)
                            )
            except BaseException as exc:
                prog.cancel()
                with contextlib.suppress(BaseException):
                    await hasher
                first: BaseException = exc
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                if isinstance(first, RangeNotSupported) and chunk < size:
                    # the origin ignores Range: fetch the file as one stream instead (bytes
                    # already fetched stay counted: they did cross the network)
                    ctx.stats.resumed -= resumed
                    chunk, done = max(size, 1), set()
                    continue
                if isinstance(first, OriginChanged | InsufficientSpace):
                    os.close(fd)
                    fd = -1
                    _discard(part, state)
                if first is exc:
                    raise
                raise first from None
            break
        actual = await hasher
        assert actual is not None
        if expected is not None and actual != expected:
            os.close(fd)
            fd = -1
            _discard(part, state)
            raise DigestMismatch(path, expected, actual)
        if ctx.fsync:
            if prog.writebacks:
                await asyncio.gather(*prog.writebacks)
            await loop.run_in_executor(ctx.executor, os.fsync, fd)
        os.fchmod(fd, 0o444)
    finally:
        if fd >= 0:
            os.close(fd)
    # a rename and an unlink wait on the filesystem journal: not on the event loop
    await loop.run_in_executor(ctx.executor, _publish_part, ctx, part, state, actual)
    return actual


def _publish_part(ctx: FillContext, part: Path, state: Path, digest: str) -> None:
    publish_file(ctx.layout, part, digest, ctx.dirty_dirs if ctx.fsync else None)
    with contextlib.suppress(FileNotFoundError):
        state.unlink()


def _disk_full(
    ctx: FillContext, location: Location, pos: int | None, exc: OSError
) -> InsufficientSpace:
    """ENOSPC/EDQUOT while writing a partial file, as the store's error with the numbers."""
    st = os.statvfs(ctx.layout.tmp)
    free = st.f_bavail * st.f_frsize
    at = f" at byte {pos}" if pos is not None else ""
    err = InsufficientSpace(
        f"disk full while writing {redact_url(location.url)} into {ctx.layout.tmp}{at} "
        f"({exc.strerror}); {format_size(free)} ({free} bytes) free there now. The "
        "partial file was removed and nothing was published: free disk space (or lower "
        "--capacity so eviction leaves room) and pull again"
    )
    err.free = free
    err.errno = exc.errno  # still ENOSPC/EDQUOT to callers that look (the pull's summary)
    return err


def _discard(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def publish_file(layout: Layout, src: Path, digest: str, dirty: set[Path] | None = None) -> Path:
    """Atomically move a verified file into ``blobs/`` (keeping an existing blob).

    The directory that changed is added to ``dirty``; the caller fsyncs those once,
    before it commits the snapshot (a directory fsync forces a journal commit, far too
    slow to do per blob on the event loop)."""
    dest = layout.blob(digest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        src.unlink()
        return dest
    os.replace(src, dest)
    if dirty is not None:
        dirty.add(dest.parent)
    return dest


def fsync_dirs(dirs: set[Path]) -> None:
    """fsync each directory (makes renames into them durable)."""
    for d in sorted(dirs):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _can_direct(source: Source, location: Location) -> bool:
    check = getattr(source, "can_direct", None)
    return bool(check is not None and check(location))


async def _fetch_direct(
    ctx: FillContext, prog: _Progress, fd: int, location: Location, i: int, pos: int, end: int
) -> None:
    """The zero-copy path: the source moves the bytes straight into ``fd`` (splice(2) for
    http://, copy_file_range(2) for file://)."""

    def landed(offset: int, n: int) -> None:
        ctx.stats.fetched += n
        prog.wrote(i, n)
        if ctx.on_bytes is not None:
            ctx.on_bytes(n)

    await ctx.source.fetch_to_fd(location, pos, end, fd, landed)  # type: ignore[attr-defined]


async def _fetch_range(
    ctx: FillContext,
    prog: _Progress,
    fd: int,
    location: Location,
    i: int,
    state: Path,
    done: set[int],
    seq: int,
    expected: str | None = None,
) -> None:
    start = i * prog.chunk
    end = start + prog.length(i)
    if ctx.peers is not None:
        async with ctx.connections.slot((i, seq)):
            origin = functools.partial(_from_source, ctx, prog, fd, location, i, start, end)
            await ctx.peers.fetch_range(ctx, prog, fd, i, start, end, expected, origin)
    else:
        await _from_source(ctx, prog, fd, location, i, start, end, slot=(i, seq))
    done.add(i)
    await asyncio.get_running_loop().run_in_executor(
        ctx.executor, _save_state, state, prog.size, prog.chunk, location.fingerprint, set(done)
    )
    if ctx.fsync:  # start writing this range to disk now, so the final fsync is short
        prog.writebacks.append(
            asyncio.get_running_loop().run_in_executor(
                ctx.executor, _start_writeback, fd, start, end - start
            )
        )


async def _from_source(
    ctx: FillContext,
    prog: _Progress,
    fd: int,
    location: Location,
    i: int,
    start: int,
    end: int,
    *,
    slot: tuple[int, int] | None = None,
) -> None:
    """Range ``i`` from the origin, retried from the byte where it stopped; takes one of
    the pull's connection slots per attempt at priority ``slot`` (None: the caller
    holds one)."""
    attempt = 0
    while True:
        pos = start + prog.filled[i]
        if pos >= end:
            break
        async with ctx.connections.slot(slot) if slot else contextlib.nullcontext():
            try:
                direct = ctx.limiter is None and ctx.origin_limiter is None and ctx.direct
                if direct and _can_direct(ctx.source, location):
                    try:
                        await _fetch_direct(ctx, prog, fd, location, i, pos, end)
                    except Unsupported:
                        ctx.direct = False  # this origin needs the full client
                    continue
                async with contextlib.aclosing(ctx.source.fetch(location, pos, end)) as stream:
                    async for data in stream:
                        n = len(data)
                        written = os.pwrite(fd, data, pos)
                        while written < n:
                            written += os.pwrite(fd, memoryview(data)[written:], pos + written)
                        pos += n
                        ctx.stats.fetched += n
                        prog.wrote(i, n)
                        if ctx.on_bytes is not None:
                            ctx.on_bytes(n)
                        if ctx.limiter is not None:
                            await ctx.limiter.take(n)
                        if ctx.origin_limiter is not None:
                            await ctx.origin_limiter.take(n)
                if pos < end:
                    raise TruncatedBody(
                        f"{redact_url(location.url)}: range ended at {pos}, expected {end}"
                    )
            except (ObjectNotFound, RangeNotSupported):
                raise
            except RETRYABLE as exc:
                attempt += 1
                if attempt > ctx.retries:
                    kind = type(exc) if isinstance(exc, TruncatedBody) else OriginUnavailable
                    raise kind(
                        f"{exc} (gave up after {attempt} attempts at bytes {pos}-{end - 1})"
                    ) from exc
                await asyncio.sleep(min(5.0, ctx.backoff * 2 ** (attempt - 1)))
                continue
            except OSError as exc:  # writing the partial file (pwrite, splice, copy_file_range)
                if exc.errno in _DISK_FULL:
                    raise _disk_full(ctx, location, start + prog.filled[i], exc) from exc
                raise
        break
