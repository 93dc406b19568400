"""The router front's requests and answers: what ``router.front`` parses, and how it
writes answers back (the proxy's ``Sink``) and relays other routes.

``FrontSink`` is the answering half of ``front.FrontProtocol`` (a base class, so the
connection object is the proxy's ``Sink`` itself, as before): ``reply`` (a whole
answer), ``start`` / ``write`` / ``end`` (a stream, chunked unless HTTP/1.0, with
backpressure while the transport is over its high-water mark), the refusal of a
request that failed to parse (answered, then read and discarded for ``LINGER_S``
before closing), and the relay of every route the front does not serve itself to the
router's aiohttp application. Split from ``front.py`` to keep each module to one
concept; the behaviour is the same (tests/integration/test_router_front.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from preheat.router import http1
from preheat.router.upstream_errors import UpstreamError
from preheat.router.wire import Incoming, error_body

if TYPE_CHECKING:
    from preheat.router.front import Front

__all__ = ["LINGER_S", "FrontRequest", "FrontSink", "Reject"]

log = logging.getLogger("preheat.router")

LINGER_S = 2.0


class Reject(Exception):
    """A request refused while it is parsed (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class FrontRequest:
    """One parsed request: either for the proxy (``incoming``) or for the relay."""

    __slots__ = ("body", "head", "host", "http10", "incoming", "keep_alive", "method", "relay")

    def __init__(self) -> None:
        self.method = b""
        self.body = b""
        self.head = False
        self.host = b""
        self.http10 = False
        self.keep_alive = True
        self.incoming: Incoming | None = None
        self.relay = b""  # target and headers for the aiohttp application


class FrontSink:
    """Answers on one client connection (see the module docstring); the parsing half
    is ``front.FrontProtocol``, which sets these attributes."""

    front: Front
    transport: asyncio.Transport | None
    cur: FrontRequest
    closed: bool
    _answered: bool
    _discard: bool
    _write_paused: bool
    _drain: asyncio.Future[None] | None
    _linger: asyncio.TimerHandle | None

    def close(self) -> None:
        """Close the connection (once); ``connection_lost`` follows from the transport."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def _refuse(self, r: Reject) -> None:
        """Answer a request refused while parsing, then linger and close."""
        self.front.reject_count(r.status)
        hdrs = {"Content-Type": "application/json; charset=utf-8"}
        body = error_body(r.status, r.message, "invalid_request_error")
        t = self.transport
        if t is None or self.closed:
            return
        t.write(http1.head(r.status, hdrs, length=len(body), keep_alive=False) + body)
        self._discard = True
        if t.can_write_eof():
            t.write_eof()
        self._linger = self.front.loop.call_later(LINGER_S, self.close)

    # --- Sink -----------------------------------------------------------------------------

    def reply(self, status: int, headers: dict[str, str], body: bytes, passed: str = "") -> None:
        req = self.cur
        self._answered = True
        t = self.transport
        if t is None or self.closed:
            return
        h = http1.head(
            status,
            headers,
            length=len(body),
            keep_alive=req.keep_alive,
            http10=req.http10,
            passed=passed,
        )
        t.write(h if req.head else h + body)

    async def start(self, status: int, headers: dict[str, str], passed: str = "") -> None:
        req = self.cur
        self._answered = True
        if req.http10:
            req.keep_alive = False  # the body ends with the connection
        t = self.transport
        if t is None or self.closed:
            raise ConnectionResetError("the client closed the connection")
        t.write(
            http1.head(
                status,
                headers,
                length=None,
                keep_alive=req.keep_alive,
                http10=req.http10,
                passed=passed,
            )
        )

    async def write(self, chunk: bytes) -> None:
        t = self.transport
        if t is None or self.closed:
            raise ConnectionResetError("the client closed the connection")
        if not chunk or self.cur.head:
            return
        t.write(chunk if self.cur.http10 else http1.chunk(chunk))
        if self._write_paused:
            d = self._drain = self.front.loop.create_future()
            try:
                await d
            finally:
                self._drain = None

    async def end(self) -> None:
        t = self.transport
        if t is not None and not self.closed and not self.cur.http10 and not self.cur.head:
            t.write(http1.LAST_CHUNK)

    # --- the relay to the aiohttp application ---------------------------------------------

    async def _relay(self, req: FrontRequest) -> None:
        target, _, headers = req.relay.partition(b"\x00")
        front = self.front
        try:
            resp = await front.pool.request(
                front.fallback,
                req.method,
                target.decode("utf-8", "surrogateescape"),
                req.body,
                headers,
                host=req.host or b"localhost",
            )
        except (UpstreamError, TimeoutError) as exc:
            log.error("the router's own application did not answer: %r", exc)
            body = error_body(502, "the router failed to answer this request", "router_error")
            self.reply(502, {"Content-Type": "application/json; charset=utf-8"}, body)
            return
        async with resp:
            passed = resp.passed  # every header of the application's answer, repeats kept
            length = resp.length
            if req.head:  # the length of the body a GET would get, and no body
                cl = resp.headers.get("content-length", "0")
                t = self.transport
                if t is not None and not self.closed:
                    t.write(
                        http1.head(
                            resp.status,
                            {},
                            length=int(cl) if cl.isdigit() else 0,
                            keep_alive=req.keep_alive,
                            http10=req.http10,
                            passed=passed,
                        )
                    )
                return
            if length is not None:
                self.reply(resp.status, {}, await resp.read(), passed)
                return
            await self.start(resp.status, {}, passed)
            async for piece in resp.iter_any():
                await self.write(piece)
            await self.end()
