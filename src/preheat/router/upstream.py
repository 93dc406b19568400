"""A lean HTTP/1.1 client for the proxy's upstream POSTs (asyncio protocols, keep-alive pool).

The router's added latency is mostly per-request Python work, and most of that was
aiohttp's client machinery (request object, URL, tracing hooks, a writer task, a
timeout context and a stream reader per request). A bare uvloop proxy in Python adds
~0.10 ms on 127.0.0.1 where the aiohttp client + server added ~0.38 ms (measured in
benchmarks/router_overhead.py's notes); this client does only what the proxy needs:

* ``POST`` the client's body bytes unchanged with the forwarded headers, in one write;
* parse the status line and headers, then the body (``router.upstream_response``) by
  ``Content-Length``, chunked transfer coding (decoded: the aiohttp server re-frames it
  for the client) or until the connection closes;
* keep connections alive per origin (LIFO, so the warmest is reused) and close those
  whose response was not read to the end;
* time out when no byte arrives for ``read_timeout`` seconds (``TimeoutError``), and
  a connect after ``connect_timeout`` (``TimeoutError``);
* apply backpressure (``router.upstream_conn``, one connection's protocol): once ``HIGH_WATER`` bytes wait unread in a connection's buffer
  (the proxy is blocked writing to a slow client), stop reading the socket
  (``pause_reading``) until the reader has taken the buffer below ``LOW_WATER``. The
  instance's own TCP send buffer then fills and it blocks: a slow client costs the
  router at most ``HIGH_WATER`` plus one read per stream, never the whole answer.

Errors (``router.upstream_errors``): ``ConnectFailed`` (the instance refused or is unreachable: it is down),
``Disconnected`` (the connection closed before the response was complete; ``reused``
says whether it was a pooled keep-alive connection, which the caller retries once on a
fresh one). Health checks and ``/v1/models`` keep using aiohttp. The front's relay to
the router's own aiohttp application (``front.py``) uses the same pool with a
``unix:/path`` origin and any method (``request``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from urllib.parse import urlsplit

from preheat.router.upstream_conn import UpstreamConn
from preheat.router.upstream_errors import BadResponse, ConnectFailed, Disconnected
from preheat.router.upstream_response import CRLF2, UpstreamResponse
from preheat.router.wire import RESP_DROP, passed_headers

__all__ = ["UpstreamPool"]

MAX_HEAD = 65536
_CONN_TOKENS = frozenset({"", "close", "keep-alive"})


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
        self._idle: dict[str, list[UpstreamConn]] = {}
        self._addr: dict[str, tuple[str, int, bytes]] = {}
        self._all: set[UpstreamConn] = set()

    def _put(self, conn: UpstreamConn) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.max_idle:
            conn.close()
            return
        conn.reused = True
        idle.append(conn)

    def _discard(self, conn: UpstreamConn) -> None:
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

    async def _connect(self, origin: str) -> UpstreamConn:
        try:
            if origin.startswith("unix:"):
                made = self.loop.create_unix_connection(
                    lambda: UpstreamConn(self, origin), origin[5:]
                )
            else:
                host, port, _ = self._address(origin)
                made = self.loop.create_connection(lambda: UpstreamConn(self, origin), host, port)
            _, conn = await asyncio.wait_for(made, self.connect_timeout)
        except TimeoutError:
            raise
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin}: {exc}") from exc
        self._all.add(conn)
        return conn

    def _take(self, origin: str) -> UpstreamConn | None:
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
        self, conn: UpstreamConn, head: bytes, body: bytes, is_head: bool
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
            i = buf.find(CRLF2)
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
