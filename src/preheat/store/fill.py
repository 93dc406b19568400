"""Parallel, verified, resumable fetch of one blob into the store's ``tmp/``.

How one file is fetched (``fetch_blob``):

- The file is cut into ``chunk``-sized ranges; each range is one ranged request holding
  one of the pull's connection slots (an ``asyncio.Semaphore`` shared by all files), so
  a single big file uses every connection and many small files share them.
- Bytes land at their offsets in ``tmp/<key>.part``: moved by the kernel where the source
  offers a direct path (splice for http://, copy_file_range for file://), else ``os.pwrite``.
  A source that already holds the whole file on the store's filesystem (an unpacked tar
  member in ``oci://`` staging) may link it there instead (``take_file``); it is then
  only hashed.
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

This module is the fetch path; its parts: :mod:`.fill_progress` (counters, the range
bookkeeping and hashing, resume state), :mod:`.fill_limits` (connection slots, rate
limit, per-blob lock), :mod:`.fill_publish` (publishing into ``blobs/``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
from collections.abc import Callable
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
from preheat.store.fill_limits import RateLimiter, Slots, lock_file, unlock_file
from preheat.store.fill_progress import FillStats, Progress, load_state, save_state, start_writeback
from preheat.store.fill_publish import discard, fsync_dirs, publish_file, publish_part
from preheat.store.layout import Layout

__all__ = [
    "DEFAULT_CHUNK",
    "RETRYABLE",
    "FillContext",
    "FillStats",
    "RateLimiter",
    "Slots",
    "fetch_blob",
    "fsync_dirs",
    "lock_file",
    "publish_file",
    "unlock_file",
]

DEFAULT_CHUNK = 32 << 20
RETRYABLE: tuple[type[BaseException], ...] = (OriginUnavailable, TruncatedBody, TimeoutError)
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # a filled disk, not a failed origin


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
        discard(ctx.layout.tmp / f"{key}.part", ctx.layout.tmp / f"{key}.json")
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
    taken = await _take(ctx, location, part, size)
    done = load_state(state, size, chunk, location.fingerprint) if part.exists() else set()
    if taken:  # the whole file is there already: only hashed, below
        done = set(range(Progress(size, chunk, set()).n))
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            if not done:
                os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
            prog = Progress(size, chunk, done)
            resumed = 0 if taken else sum(prog.length(i) for i in done)
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
                    discard(part, state)
                if first is exc:
                    raise
                raise first from None
            break
        actual = await hasher
        assert actual is not None
        if expected is not None and actual != expected:
            os.close(fd)
            fd = -1
            discard(part, state)
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
    await loop.run_in_executor(ctx.executor, publish_part, ctx, part, state, actual)
    return actual


async def _take(ctx: FillContext, location: Location, part: Path, size: int) -> bool:
    """Whether the source put the whole file at ``part`` itself (``take_file``: a tar
    member staged on the store's filesystem is hard-linked there, not copied); its bytes
    then count as fetched, and it is hashed and verified like any other partial file."""
    take = getattr(ctx.source, "take_file", None)
    if take is None or part.exists() or not await take(location, part):
        return False
    ctx.stats.fetched += size
    if ctx.on_bytes is not None:
        ctx.on_bytes(size)
    return True


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


def _can_direct(source: Source, location: Location) -> bool:
    check = getattr(source, "can_direct", None)
    return bool(check is not None and check(location))


async def _fetch_direct(
    ctx: FillContext, prog: Progress, fd: int, location: Location, i: int, pos: int, end: int
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
    prog: Progress,
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
        ctx.executor, save_state, state, prog.size, prog.chunk, location.fingerprint, set(done)
    )
    if ctx.fsync:  # start writing this range to disk now, so the final fsync is short
        prog.writebacks.append(
            asyncio.get_running_loop().run_in_executor(
                ctx.executor, start_writeback, fd, start, end - start
            )
        )


async def _from_source(
    ctx: FillContext,
    prog: Progress,
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
