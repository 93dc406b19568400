"""A lean HTTP/1.1 client for the proxy's upstream POSTs (asyncio protocols, keep-alive pool).

The router's added latency is mostly per-request Python work, and most of that was
aiohttp's client machinery (request object, URL, tracing hooks, a writer task, a
timeout context and a stream reader per request). A bare uvloop proxy in Python adds
~0.10 ms on 127.0.0.1 where the aiohttp client + server added ~0.38 ms (measured in
benchmarks/router_overhead.py's notes); this client does only what the proxy needs:

* ``POST`` the client's body bytes unchanged with the forwarded headers, in one write;
* parse the status line and headers, then the body by ``Content-Length``, chunked
  transfer coding (decoded: the aiohttp server re-frames it for the client) or until
  the connection closes;
* keep connections alive per origin (LIFO, so the warmest is reused) and close those
  whose response was not read to the end;
* time out when no byte arrives for ``read_timeout`` seconds (``TimeoutError``), and
  a connect after ``connect_timeout`` (``TimeoutError``);
* apply backpressure: once ``HIGH_WATER`` bytes wait unread in a connection's buffer
  (the proxy is blocked writing to a slow client), stop reading the socket
  (``pause_reading``) until the reader has taken the buffer below ``LOW_WATER``. The
  instance's own TCP send buffer then fills and it blocks: a slow client costs the
  router at most ``HIGH_WATER`` plus one read per stream, never the whole answer.

Errors: ``ConnectFailed`` (the instance refused or is unreachable: it is down),
``Disconnected`` (the connection closed before the response was complete; ``reused``
says whether it was a pooled keep-alive connection, which the caller retries once on a
fresh one). Health checks and ``/v1/models`` keep using aiohttp. The front's relay to
the router's own aiohttp application (``front.py``) uses the same pool with a
``unix:/path`` origin and any method (``request``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from urllib.parse import urlsplit

from preheat.router.wire import RESP_DROP, passed_headers

MAX_HEAD = 65536
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
_CRLF2 = b"\r\n\r\n"
_CONN_TOKENS = frozenset({"", "close", "keep-alive"})


class UpstreamError(Exception):
    """An upstream connection failed (see the subclasses)."""


class ConnectFailed(UpstreamError):
    """The instance refused the connection or cannot be reached."""


class Disconnected(UpstreamError):
    """The connection closed before the response was complete."""

    def __init__(self, message: str, *, reused: bool, started: bool) -> None:
        super().__init__(message)
        self.reused = reused
        self.started = started


class BadResponse(UpstreamError):
    """The instance sent something that is not an HTTP/1.x response."""


class _Conn(asyncio.Protocol):
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


class UpstreamResponse:
    """A response being read from a ``_Conn``: status, headers (lower-case names, the last
    value of a repeated one), ``passed`` (the header lines to pass on to the client, every
    value, as ``wire.passed_headers`` filters them) and the
    body through ``read()`` or ``iter_any()``. Use as an async context manager: leaving
    it returns a fully read connection to the pool and closes any other."""

    __slots__ = ("_chunked", "_done", "_left", "conn", "headers", "keep_alive", "passed", "status")

    def __init__(
        self,
        conn: _Conn,
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
                    j = buf.find(_CRLF2)
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


class UpstreamPool:
    """Keep-alive connections per origin (``http://host:port``, or ``unix:/path`` for a
    unix socket) and the requests to use them."""

    def __init__(
        self,
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
        max_idle_per_origin: int = 256,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle_per_origin
        self._idle: dict[str, list[_Conn]] = {}
        self._addr: dict[str, tuple[str, int, bytes]] = {}
        self._all: set[_Conn] = set()

    def _put(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.max_idle:
            conn.close()
            return
        conn.reused = True
        idle.append(conn)

    def _discard(self, conn: _Conn) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def _address(self, origin: str) -> tuple[str, int, bytes]:
        a = self._addr.get(origin)
        if a is None and origin.startswith("unix:"):
            a = self._addr[origin] = (origin[5:], 0, b"localhost")
        if a is None:
            u = urlsplit(origin)
            if u.scheme != "http" or not u.hostname:
                raise ConnectFailed(f"{origin!r} is not an http://host:port URL")
            port = u.port or 80
            a = self._addr[origin] = (u.hostname, port, u.netloc.encode("idna"))
        return a

    async def _connect(self, origin: str) -> _Conn:
        try:
            if origin.startswith("unix:"):
                made = self.loop.create_unix_connection(lambda: _Conn(self, origin), origin[5:])
            else:
                host, port, _ = self._address(origin)
                made = self.loop.create_connection(lambda: _Conn(self, origin), host, port)
            _, conn = await asyncio.wait_for(made, self.connect_timeout)
        except TimeoutError:
            raise
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin}: {exc}") from exc
        self._all.add(conn)
        return conn

    def _take(self, origin: str) -> _Conn | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.buf:
                return conn
            conn.close()
        return None

    async def post(
        self, origin: str, path: str, body: bytes, headers: Mapping[str, str] | bytes
    ) -> UpstreamResponse:
        """POST ``body`` to ``origin + path``; a pooled connection that turns out stale is
        replaced by a fresh one once (``Disconnected.reused`` otherwise). ``headers`` is
        a mapping or one pre-encoded block of ``\r\nName: value`` lines."""
        return await self.request(origin, b"POST", path, body, headers)

    async def request(
        self,
        origin: str,
        method: bytes,
        target: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        *,
        host: bytes | None = None,
    ) -> UpstreamResponse:
        """Any method: ``target`` is the path with its query; ``host`` replaces the
        origin's ``Host`` header; a ``HEAD`` answer has no body whatever it declares."""
        if not isinstance(headers, bytes):
            headers = "".join(f"\r\n{k}: {v}" for k, v in headers.items()).encode(
                "utf-8", "surrogateescape"
            )
        head = b"".join(
            (
                method,
                b" ",
                target.encode("utf-8", "surrogateescape"),
                b" HTTP/1.1\r\nHost: ",
                host if host is not None else self._address(origin)[2],
                headers,
                b"\r\nContent-Length: %d\r\n\r\n" % len(body),
            )
        )
        is_head = method == b"HEAD"
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, head, body, is_head)
            except Disconnected as exc:
                if exc.started:
                    raise
        conn = await self._connect(origin)
        return await self._exchange(conn, head, body, is_head)

    async def _exchange(
        self, conn: _Conn, head: bytes, body: bytes, is_head: bool
    ) -> UpstreamResponse:
        reused = conn.reused
        transport = conn.transport
        if transport is None or conn.closed or transport.is_closing():
            conn.close()
            raise Disconnected("the pooled connection is closed", reused=reused, started=False)
        transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            transport.write(body)
        buf = conn.buf
        timeout = self.read_timeout
        while True:
            i = buf.find(_CRLF2)
            if i >= 0:
                break
            if len(buf) > MAX_HEAD:
                conn.close()
                raise BadResponse("response headers over 64 KiB")
            if conn.closed:
                raise Disconnected(
                    "the instance closed the connection before answering",
                    reused=reused,
                    started=bool(buf),
                )
            try:
                await conn.wait_data(timeout)
            except BaseException:
                conn.close()
                raise
        lines = bytes(buf[:i]).decode("latin-1").split("\r\n")
        del buf[: i + 4]
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
            conn.close()
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        try:
            status = int(status_line[1])
        except ValueError as exc:
            conn.close()
            raise BadResponse(f"bad status {status_line[1]!r}") from exc
        hdrs: dict[str, str] = {}
        kept: list[str] = []  # the lines passed on to the client, as they came
        drop = RESP_DROP
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                low = k.strip().lower()
                hdrs[low] = v.strip()
                if low not in drop:
                    kept.append(line)
        named = hdrs.get("connection")
        if named and kept and set(named.lower().replace(" ", "").split(",")) - _CONN_TOKENS:
            # It names headers to drop: the full filter.
            cut = (ln.partition(":") for ln in lines[1:] if ":" in ln)
            passed = passed_headers((k.strip(), v.strip()) for k, _, v in cut)
        else:
            passed = "\r\n".join(kept) + "\r\n" if kept else ""
        keep = status_line[0] == "HTTP/1.1" and hdrs.get("connection", "").lower() != "close"
        if 100 <= status < 200:  # never asked for (no Expect is forwarded)
            conn.close()
            raise BadResponse(f"unexpected interim response {status}")
        try:
            resp = UpstreamResponse(conn, status, hdrs, keep, head=is_head, passed=passed)
        except BadResponse:
            conn.close()
            raise
        conn.resp = resp
        return resp

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
