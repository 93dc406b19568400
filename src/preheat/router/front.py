"""The router's HTTP/1.1 front: an ``asyncio.Protocol`` with httptools on the public port.

Why: in front of fast engines the router's added latency was mostly aiohttp's server
machinery (request and response objects, the router table, a stream reader, a writer;
a third of the process's time in py-spy, docs/benchmarks.md). The front parses
requests with ``httptools`` (llhttp, the parser uvicorn uses) and serves the two proxy
routes itself, ``POST /v1/completions`` and ``POST /v1/chat/completions``, through
``proxy.Proxy.handle``: the body and a pre-encoded header block go to the instance,
the answer comes back in one write.

Every other request (``/health``, ``/metrics``, ``/v1/models``, ``/admin/...``, any
other method or path) is relayed unchanged to the router's aiohttp application, which
listens on a unix socket in a private temporary directory (``server.serve``); the relay
uses the same keep-alive client as the instances (``upstream.py``). So all routes stay
on one port, and the admin API, metrics and health are aiohttp code as before.

What the front gets right (tests/integration/test_router_front.py):

* keep-alive (HTTP/1.1 by default, HTTP/1.0 with ``Connection: keep-alive``) and
  pipelining: requests on one connection are answered one at a time, in order; more
  than ``MAX_PIPELINED`` waiting (or ``MAX_QUEUED_BYTES`` of their bodies) stops
  reading the socket until half of them are answered;
* request bodies by ``Content-Length`` or chunked; ``Expect: 100-continue`` answered
  with ``100 Continue`` when the body would be accepted (and nothing is ahead of it);
* limits: a request line over 8,190 bytes -> 414, more than 128 headers or 64 KiB of
  head -> 431, a body over ``max_body_bytes`` -> 413 (refused from ``Content-Length``
  before the body is read), anything llhttp cannot parse (bad framing, both
  ``Content-Length`` and chunked, bad characters) -> 400; each in the OpenAI error
  format with ``Connection: close``, after which the connection reads and discards for
  ``front_sink.LINGER_S`` so the client sees the answer rather than a reset;
* streams (SSE) are passed on as chunked transfer coding, one chunk per piece the
  instance sent, written at once; a slow client applies backpressure (``write`` waits
  while the transport is over its high-water mark);
* a client that disconnects (or half-closes: the end of its input is taken as a hang-up,
  as nginx does) cancels its request at once, not at the next write: the upstream
  connection is closed, so the engine stops generating, and the request leaves the
  in-flight count;
* a connection idle for ``IDLE_S`` with nothing in progress is closed;
* the answer's headers are the instance's (or the aiohttp application's) own, every
  value of a repeated one kept (``wire.passed_headers``: hop-by-hop, framing and
  ``Date`` left out), then the router's (tests/integration/test_router_headers.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

import httptools

from preheat.router import http1
from preheat.router.front_sink import FrontRequest, FrontSink, Reject
from preheat.router.state import VARIANT_HEADER
from preheat.router.wire import HINT_HEADER, HOP, Incoming, error_body, too_large_message

if TYPE_CHECKING:
    from preheat.router.proxy import Proxy
    from preheat.router.state import RoutingState
    from preheat.router.upstream import UpstreamPool

log = logging.getLogger("preheat.router")

MAX_PIPELINED = 16
#: Body bytes of pipelined requests waiting their turn before reading pauses.
MAX_QUEUED_BYTES = 1 << 20
IDLE_S = 75.0
_SWEEP_S = 5.0
PROXY_PATHS = {
    b"/v1/completions": "/v1/completions",
    b"/v1/chat/completions": "/v1/chat/completions",
}
_VARIANT = VARIANT_HEADER.lower().encode()
_HINT = HINT_HEADER.lower().encode()
_HOP = frozenset(h.encode() for h in HOP)
#: Not passed to the aiohttp application (framing is the relay's own; Host goes apart).
_RELAY_HOP = frozenset(
    {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te"}
    | {b"upgrade", b"expect"}
)


class Front:
    """The listening side: the proxy, the relay target, the open connections."""

    def __init__(self, proxy: Proxy, pool: UpstreamPool, fallback: str) -> None:
        self.proxy = proxy
        self.state: RoutingState = proxy.state
        self.pool = pool
        self.fallback = fallback
        self.conns: set[FrontProtocol] = set()
        self.tick = 0
        # Cached: asyncio.get_running_loop() costs a getpid() syscall on each call.
        self.loop = pool.loop
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> list[tuple[str, int]]:
        """Listen on ``host:port``; returns the bound addresses."""
        self._server = await self.loop.create_server(
            lambda: FrontProtocol(self), host, port, reuse_address=True, backlog=1024
        )
        self._sweeper = asyncio.create_task(self._sweep(), name="router-front-idle")
        return [s.getsockname()[:2] for s in self._server.sockets]

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            self.tick += 1
            for conn in list(self.conns):
                if conn.task is None and self.tick - conn.seen >= IDLE_S / _SWEEP_S:
                    conn.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.conns):
            conn.close()
            if conn.task is not None:
                conn.task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    def reject_count(self, status: int) -> None:
        m = self.state.metrics
        m.child(m.rejected, str(status)).inc()


class FrontProtocol(FrontSink, asyncio.Protocol):
    """One client connection: parse, queue, answer in order (also the proxy's ``Sink``)."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[FrontRequest | Reject] = deque()
        self.task: asyncio.Task[None] | None = None
        self.cur = FrontRequest()  # the request being answered
        self._parsing = self.cur  # the request being parsed (ahead of cur when pipelined)
        self.closed = False
        self.seen = front.tick
        self._parts: list[bytes] = []
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body_bytes = 0
        self._limit = front.state.config.max_body_bytes
        self._reject: Reject | None = None
        self._discard = False
        self._read_paused = False
        self._queued_bytes = 0
        self._write_paused = False
        self._answered = False  # a head was written for the current request
        self._drain: asyncio.Future[None] | None = None
        self._linger: asyncio.TimerHandle | None = None

    # --- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.front.conns.add(self)

    def data_received(self, data: bytes) -> None:
        self.seen = self.front.tick
        if self._discard:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No route upgrades: answer what was parsed, then close.
            self._stop_parsing()
        except httptools.HttpParserError as exc:
            r = self._reject or Reject(400, f"malformed HTTP request: {exc}")
            self._reject = None
            self.queue.append(r)
            self._stop_parsing()
            self._kick()

    def eof_received(self) -> bool:
        # The client hung up (a half-close included, as nginx treats it): close, which
        # cancels a request in progress (connection_lost).
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.front.conns.discard(self)
        if self._linger is not None:
            self._linger.cancel()
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("the client closed the connection"))
        if self.task is not None:
            # Nobody is left to answer: stop the request (closes the upstream connection).
            self.task.cancel()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    # --- parser callbacks (httptools) ---------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._parts = []
        self._head_bytes = 0
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > http1.MAX_LINE:
            self._reject = Reject(414, f"the request target is over {http1.MAX_LINE} bytes")
            raise self._reject

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._headers.append((name, value))
        if len(self._headers) > http1.MAX_HEADERS or self._head_bytes > http1.MAX_HEAD_BYTES:
            self._reject = Reject(
                431,
                f"the request has over {http1.MAX_HEADERS} headers or "
                f"{http1.MAX_HEAD_BYTES} bytes of them",
            )
            raise self._reject

    def on_headers_complete(self) -> None:
        p = self.parser
        req = FrontRequest()
        req.method = method = p.get_method()
        req.head = method == b"HEAD"
        req.http10 = p.get_http_version() == "1.0"
        req.keep_alive = p.should_keep_alive()
        path, _, _ = self._url.partition(b"?")
        route = PROXY_PATHS.get(path) if method == b"POST" else None
        fwd: list[bytes] = []
        variant = request_id = hint = None
        expect = False
        for name, value in self._headers:
            low = name.lower()
            if low == b"content-length":
                if not value.isdigit():
                    self._reject = Reject(400, "Content-Length is not a number")
                    raise self._reject
                if int(value) > self._limit:
                    self._reject = Reject(413, too_large_message(self._limit))
                    raise self._reject
            elif low == b"expect":
                expect = value.lower() == b"100-continue"
            elif low == b"host":
                req.host = value
            if route is not None:
                if low in _HOP:
                    if low == b"x-request-id" and value:
                        request_id = value.decode("utf-8", "surrogateescape")
                    continue
                if low == _VARIANT:
                    variant = value.decode("utf-8", "surrogateescape")
                elif low == _HINT:
                    hint = value.decode("utf-8", "surrogateescape")
                fwd.append(b"\r\n%b: %b" % (name, value))
            elif low not in _RELAY_HOP:
                fwd.append(b"\r\n%b: %b" % (name, value))
        if route is not None:
            req.incoming = Incoming(route, b"", variant, request_id, hint, b"".join(fwd))
        else:
            req.relay = self._url + b"\x00" + b"".join(fwd)
        self._parsing = req
        if expect and not req.http10 and self.task is None and not self.queue:
            assert self.transport is not None
            self.transport.write(http1.CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._limit:
            self._reject = Reject(413, too_large_message(self._limit))
            raise self._reject
        self._parts.append(body)

    def on_message_complete(self) -> None:
        req = self._parsing
        parts = self._parts
        req.body = parts[0] if len(parts) == 1 else b"".join(parts)
        if req.incoming is not None:
            req.incoming.raw = req.body
        self.queue.append(req)
        self._queued_bytes += len(req.body)
        full = len(self.queue) >= MAX_PIPELINED or self._queued_bytes >= MAX_QUEUED_BYTES
        if full and not self._read_paused:
            self._read_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._kick()

    # --- answering ------------------------------------------------------------------------

    def _stop_parsing(self) -> None:
        self._discard = True

    def _kick(self) -> None:
        if self.task is None and not self.closed:
            self.task = self.front.loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.queue and not self.closed:
                req = self.queue.popleft()
                if isinstance(req, FrontRequest):
                    self._queued_bytes -= len(req.body)
                if (
                    self._read_paused
                    and len(self.queue) < MAX_PIPELINED // 2
                    and self._queued_bytes < MAX_QUEUED_BYTES // 2
                ):
                    self._read_paused = False
                    assert self.transport is not None
                    self.transport.resume_reading()
                if isinstance(req, Reject):
                    self._refuse(req)
                    return
                self.cur = req
                self._answered = False
                try:
                    if req.incoming is not None:
                        await self.front.proxy.handle(req.incoming, self)
                    else:
                        await self._relay(req)
                except (asyncio.CancelledError, ConnectionError):
                    raise
                except Exception:
                    log.exception("the router failed a request")
                    if not self._answered:  # as aiohttp would: a 500, then close
                        req.keep_alive = False
                        body = error_body(500, "the router failed on this request", "router_error")
                        self.reply(500, {"Content-Type": "application/json; charset=utf-8"}, body)
                    self.close()
                    return
                if not req.keep_alive:
                    self.close()
                    return
            if self._discard and not self.closed:
                self.close()  # parsing stopped (an upgrade) and everything is answered
        except ConnectionError:
            self.close()
        finally:
            self.task = None
