"""What the blob fills of a pull share: its connection slots (``Slots``, lowest priority
first), its bandwidth (``RateLimiter``, a token bucket), and the per-blob ``flock`` that
makes two pullers of the same blob fetch it once (correctness never depends on it)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

__all__ = ["RateLimiter", "Slots", "lock_file", "unlock_file"]


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
