"""One keep-alive upstream connection: an asyncio protocol with read backpressure.

Once ``HIGH_WATER`` bytes wait unread in the connection's buffer (the proxy is blocked
writing to a slow client), it stops reading the socket (``pause_reading``) until the
reader has taken the buffer below ``LOW_WATER``. The instance's own TCP send buffer then
fills and it blocks: a slow client costs the router at most ``HIGH_WATER`` plus one read
per stream, never the whole answer. A wait for data times out after ``read_timeout``
seconds of silence (``TimeoutError``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from preheat.router.upstream import UpstreamPool
    from preheat.router.upstream_response import UpstreamResponse

__all__ = ["HIGH_WATER", "LOW_WATER", "UpstreamConn"]

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class UpstreamConn(asyncio.Protocol):
    """One keep-alive connection; it parses one response at a time."""

    __slots__ = (
        "buf",
        "closed",
        "origin",
        "paused",
        "pool",
        "resp",
        "reused",
        "transport",
        "waiter",
    )

    def __init__(self, pool: UpstreamPool, origin: str) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.closed = False
        self.waiter: asyncio.Future[None] | None = None
        self.reused = False
        self.paused = False
        self.resp: UpstreamResponse | None = None

    # --- protocol callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if len(buf) > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)
        self.pool._discard(self)

    # --- reading --------------------------------------------------------------------------

    def consumed(self) -> None:
        """The reader took bytes out of ``buf``: resume reading below ``LOW_WATER``."""
        if self.paused and len(self.buf) < LOW_WATER:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    async def wait_data(self, timeout: float | None) -> None:
        """Wait until more bytes arrive or the connection closes; TimeoutError after
        ``timeout`` seconds of silence."""
        if self.paused:  # the reader needs more than what is buffered: read again
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        loop = self.pool.loop
        w = self.waiter = loop.create_future()
        handle = None
        if timeout is not None:
            handle = loop.call_later(timeout, _expire, w)
        try:
            await w
        finally:
            self.waiter = None
            if handle is not None:
                handle.cancel()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self.pool._discard(self)


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(TimeoutError())
