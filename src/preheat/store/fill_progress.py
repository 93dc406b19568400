"""What one blob fill keeps track of: the byte counters of a pull (``FillStats``), the
ranges written to a partial file and the hash that follows its contiguous prefix
(``Progress``), the kernel writeback of finished ranges, and the resume state file
``tmp/<key>.json`` (the ranges already on disk). Used by :mod:`preheat.store.fill`."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FillStats", "Progress", "load_state", "save_state", "start_writeback"]

_HASH_READ = 8 << 20

_libc = None
with contextlib.suppress(OSError, AttributeError):
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def start_writeback(fd: int, offset: int, length: int) -> None:
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


class Progress:
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


def load_state(path: Path, size: int, chunk: int, fingerprint: str) -> set[int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    if data.get("size") != size or data.get("chunk") != chunk or data.get("fp") != fingerprint:
        return set()
    return {int(i) for i in data.get("done", [])}


def save_state(path: Path, size: int, chunk: int, fingerprint: str, done: set[int]) -> None:
    # unique per call: ranges finish in threads at once (an older list winning only means
    # a resume fetches a range again)
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.new")
    tmp.write_text(
        json.dumps({"size": size, "chunk": chunk, "fp": fingerprint, "done": sorted(done)})
    )
    os.replace(tmp, path)
