"""A zero-copy fast path for ranged GETs over plain ``http://`` (Linux only).

aiohttp hands every body chunk to Python as a new ``bytes`` object that the fill then
copies into the page cache: two copies and an allocation per chunk. On a fast origin
(another node on the LAN, nginx on 127.0.0.1) those copies, not the network, bound the
fill. Here the body moves socket -> pipe -> file with ``splice(2)`` on the event loop:
the kernel moves pages, Python only counts bytes. The request is plain HTTP/1.1 on a
pooled keep-alive socket (one the server closed while it sat idle, after a timeout or a
restart, fails before any response byte: the request goes again, once, on a fresh
socket, and the other idle ones are dropped); anything unusual (redirect, chunked
encoding, compression) raises ``Unsupported`` and the caller falls back to aiohttp. The caller adds
its conditional and auth headers, and checks each answer's status and headers (a file
changed at the origin) before any body byte is read. ``url`` is only ever used in
messages, so callers pass it redacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Callable, Mapping

from preheat.errors import FetchError, ObjectNotFound, OriginUnavailable, TruncatedBody
from preheat.sources.base import Unsupported

AVAILABLE = hasattr(os, "splice") and hasattr(os, "SPLICE_F_NONBLOCK")
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031
_MAX_HEADER = 64 << 10
# errors of writing the file, not of the origin: the fill reports them (disk full)
_LOCAL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})

__all__ = ["AVAILABLE", "SplicePool", "Unsupported"]


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.r, self.w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.w, _F_SETPIPE_SZ, _PIPE_SIZE)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


class _Stale(Exception):
    """The socket failed before a single byte of the response: the peer had closed it."""


class SplicePool:
    """Keep-alive connections to one ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, addr), 10)
            except BaseException:
                sock.close()
                raise
        except (OSError, TimeoutError) as exc:
            raise OriginUnavailable(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return _Conn(sock)

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()

    async def get_range(
        self,
        path: str,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        check: Callable[[int, Mapping[str, str]], None] | None = None,
    ) -> None:
        """GET bytes [start, end) of ``path`` into ``fd`` at the same offsets.

        ``on_bytes(offset, n)`` is called after each piece lands in the file; ``headers``
        are added to the request; ``check(status, headers)`` (lower-case names) may raise
        to refuse an answer before its body is read.
        """
        extra = "".join(
            f"{k}: {v}\r\n"
            for k, v in (headers or {}).items()
            if not any(c in f"{k}{v}" for c in "\r\n")
        )
        reused = bool(self._idle)
        conn = self._idle.pop() if reused else await self._connect()
        reusable = False
        try:
            try:
                reusable = await self._exchange(
                    conn, path, start, end, fd, on_bytes, url, extra, check
                )
            except _Stale as exc:
                if not reused:
                    raise OriginUnavailable(f"{url}: {exc}") from exc
                # the peer closed a kept-alive socket (idle timeout, restart) before it
                # read the request: the others are as old; the request again, once, fresh
                conn.close()
                self.close()
                conn = await self._connect()
                try:
                    reusable = await self._exchange(
                        conn, path, start, end, fd, on_bytes, url, extra, check
                    )
                except _Stale as again:
                    raise OriginUnavailable(f"{url}: {again}") from again
        except FetchError:
            raise
        except OSError as exc:
            if exc.errno in _LOCAL_ERRNOS:
                raise
            raise OriginUnavailable(f"{url}: {exc.__class__.__name__}: {exc}") from exc
        finally:
            if reusable:
                self._idle.append(conn)
            else:
                conn.close()

    async def _exchange(
        self,
        conn: _Conn,
        path: str,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
        url: str,
        extra: str,
        check: Callable[[int, Mapping[str, str]], None] | None,
    ) -> bool:
        loop = asyncio.get_running_loop()
        sock = conn.sock
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Range: bytes={start}-{end - 1}\r\nAccept-Encoding: identity\r\n"
            f"User-Agent: preheat\r\n{extra}\r\n"
        )
        buf = b""
        try:
            await loop.sock_sendall(sock, request.encode("ascii"))
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 60)
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
            raise _Stale(f"{exc.__class__.__name__} before the response") from exc
        if not data:
            raise _Stale("connection closed before the response headers")
        buf += data
        while b"\r\n\r\n" not in buf:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 60)
            if not data:
                raise OriginUnavailable(f"{url}: connection closed before the response headers")
            buf += data
            if len(buf) > _MAX_HEADER:
                raise Unsupported(f"{url}: response headers larger than {_MAX_HEADER} bytes")
        head, body = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise OriginUnavailable(f"{url}: malformed status line {lines[0]!r}") from exc
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if check is not None:
            check(status, headers)
        if status in (404, 410):
            raise ObjectNotFound(f"{url}: the origin answered {status} (not found); check the URL")
        if status in (401, 403):
            raise ObjectNotFound(f"{url}: the origin answered {status} (access denied)")
        if status == 416:
            raise TruncatedBody(f"{url}: range {start}-{end - 1} not satisfiable (416)")
        if status >= 500:
            raise OriginUnavailable(f"{url}: the origin answered HTTP {status}")
        if status != 206 and not (status == 200 and start == 0):
            raise Unsupported(f"{url}: status {status} on a ranged GET")
        if headers.get("transfer-encoding") or headers.get("content-encoding", "identity") not in (
            "identity",
            "",
        ):
            raise Unsupported(f"{url}: encoded body ({headers.get('transfer-encoding')})")
        length = int(headers.get("content-length", "-1"))
        want = end - start
        if status == 206 and length != want:
            if 0 <= length < want:
                # nginx clips a range that runs past the end of the file
                raise TruncatedBody(
                    f"{url}: origin has {length} bytes from {start}, expected {want}"
                )
            raise Unsupported(f"{url}: Content-Length {length}, expected {want}")
        if status == 200 and length < want:
            raise TruncatedBody(f"{url}: origin has {length} bytes, expected {want}")
        pos = start
        if body:
            body = body[: end - pos]
            n = os.pwrite(fd, body, pos)
            on_bytes(pos, n)
            pos += n
        sfd = sock.fileno()
        flags = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE
        while pos < end:
            try:
                n = os.splice(sfd, conn.w, min(_PIPE_SIZE, end - pos), flags=flags)
            except BlockingIOError:
                await _readable(loop, sfd, 60, url, pos)
                continue
            if n == 0:
                raise TruncatedBody(f"{url}: body ended at byte {pos}, expected {end}")
            while n:
                m = os.splice(conn.r, fd, n, offset_dst=pos)
                on_bytes(pos, m)
                pos += m
                n -= m
        # a 200 for a range that is the whole file has nothing extra; anything else would
        # be left unread on the socket, so only reuse when the body was exactly the range
        return length == want and headers.get("connection", "").lower() != "close"


async def _readable(
    loop: asyncio.AbstractEventLoop, fd: int, timeout: float, url: str, pos: int
) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await asyncio.wait_for(fut, timeout)
    except TimeoutError as exc:
        raise OriginUnavailable(f"{url}: no data for {timeout:.0f} s at byte {pos}") from exc
    finally:
        loop.remove_reader(fd)
