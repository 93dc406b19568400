"""One upstream response being read: status, headers and the body.

The body is read by ``Content-Length``, chunked transfer coding (decoded: the aiohttp
server re-frames it for the client) or until the connection closes; a response read to
the end returns its connection to the pool, any other closes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING

from preheat.router.upstream_errors import BadResponse, Disconnected

if TYPE_CHECKING:
    from preheat.router.upstream_conn import UpstreamConn

__all__ = ["CRLF2", "UpstreamResponse"]

CRLF2 = b"\r\n\r\n"


class UpstreamResponse:
    """A response being read from a ``UpstreamConn``: status, headers (lower-case names, the last
    value of a repeated one), ``passed`` (the header lines to pass on to the client, every
    value, as ``wire.passed_headers`` filters them) and the
    body through ``read()`` or ``iter_any()``. Use as an async context manager: leaving
    it returns a fully read connection to the pool and closes any other."""

    __slots__ = ("_chunked", "_done", "_left", "conn", "headers", "keep_alive", "passed", "status")

    def __init__(
        self,
        conn: UpstreamConn,
        status: int,
        headers: dict[str, str],
        keep: bool,
        *,
        head: bool = False,
        passed: str = "",
    ) -> None:
        self.conn = conn
        self.status = status
        self.headers = headers
        self.passed = passed
        te = headers.get("transfer-encoding", "")
        self._chunked = "chunked" in te.lower()
        cl = headers.get("content-length")
        self._left: int | None = None
        if not self._chunked and cl is not None:
            try:
                self._left = int(cl)
            except ValueError as exc:
                raise BadResponse(f"bad Content-Length {cl!r}") from exc
        if head or status in (204, 304):
            self._chunked = False
            self._left = 0
        self.keep_alive = keep and (self._chunked or self._left is not None)
        self._done = self._left == 0 and not self._chunked

    @property
    def length(self) -> int | None:
        """The body's declared length (``Content-Length``), None when chunked or
        delimited by the close; read before the body is."""
        return None if self._chunked else self._left

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        conn = self.conn
        if self._done and self.keep_alive and not conn.closed and not conn.buf:
            conn.resp = None
            conn.pool._put(conn)
        else:
            conn.close()

    async def read(self) -> bytes:
        """The whole body."""
        buf = self.conn.buf
        left = self._left
        if self._done:
            return b""
        if not self._chunked and left is not None and len(buf) >= left:
            data = bytes(buf[:left])  # the usual case: it all came with the headers
            del buf[:left]
            self._left = 0
            self._done = True
            self.conn.consumed()
            return data
        parts = []
        async for chunk in self.iter_any():
            parts.append(chunk)
        return b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunked transfer coding decoded)."""
        conn = self.conn
        timeout = conn.pool.read_timeout
        if self._chunked:
            async for piece in self._iter_chunked(timeout):
                yield piece
            return
        while not self._done:
            buf = conn.buf
            if buf:
                left = self._left
                if left is None:
                    data = bytes(buf)
                    buf.clear()
                else:
                    data = bytes(buf[:left])
                    del buf[:left]
                    left -= len(data)
                    self._left = left
                    if left == 0:
                        self._done = True
                conn.consumed()
                yield data
                continue
            if conn.closed:
                if self._left is None:  # read until close: the close ends the body
                    self._done = True
                    return
                raise Disconnected(
                    "the instance closed the connection mid-response",
                    reused=False,
                    started=True,
                )
            await conn.wait_data(timeout)

    async def _iter_chunked(self, timeout: float | None) -> AsyncIterator[bytes]:
        conn = self.conn
        buf = conn.buf
        while True:
            # size line
            while True:
                i = buf.find(b"\r\n")
                if i >= 0:
                    break
                if len(buf) > 1024:
                    raise BadResponse("chunk size line too long")
                await self._more(timeout)
            size_s = bytes(buf[:i]).split(b";", 1)[0].strip()
            try:
                size = int(size_s, 16)
            except ValueError as exc:
                raise BadResponse(f"bad chunk size {size_s!r}") from exc
            del buf[: i + 2]
            if size == 0:
                # trailers end with an empty line
                while True:
                    if buf[:2] == b"\r\n":
                        del buf[:2]
                        self._done = True
                        return
                    j = buf.find(CRLF2)
                    if j >= 0:
                        del buf[: j + 4]
                        self._done = True
                        return
                    await self._more(timeout)
            left = size
            while left:
                if not buf:
                    await self._more(timeout)
                    continue
                data = bytes(buf[:left])
                del buf[: len(data)]
                left -= len(data)
                conn.consumed()
                yield data
            while len(buf) < 2:
                await self._more(timeout)
            del buf[:2]

    async def _more(self, timeout: float | None) -> None:
        conn = self.conn
        if conn.closed:
            raise Disconnected(
                "the instance closed the connection mid-response", reused=False, started=True
            )
        await conn.wait_data(timeout)
