"""A node's peer blob server: the blobs its store holds, to other nodes, over HTTP.

Routes (read-only, digest-addressed; anything else is 404, any other method 405):

``GET|HEAD /blobs/sha256:<hex>``
    The blob's bytes, one ``Range: bytes=a-b`` per request (206), or all of it (200).
    A published blob (complete and verified) is served whole, by sendfile. A blob the
    node is still filling is served from its partial file for ranges that lie entirely
    in pieces it holds: verified against the piece list (a fill from peers) or landed
    and hashed (a fill from the origin, ``sources.pieces.PieceBook.landed``); other
    ranges are 416, a blob the node does not hold is 404.
``GET /blobs/sha256:<hex>/pieces``
    JSON ``{"size", "piece", "digests", "complete", "have"}``: the piece list (hashed
    from the published blob once, then kept; ``""`` for a piece of an origin fill that
    has not landed yet) and the pieces held.

Every request needs ``Authorization: Bearer <cluster token>`` (compared in constant
time); without it the answer is 401 and nothing about the store. The token is held in
memory only: never on a command line, in a log line, a header we send back or an error.
The server binds 127.0.0.1 (local mode) on its own port; ``serving`` counts transfers
in flight, so receivers prefer peers that are not busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from preheat.sources.pieces import PIECE_SIZE, PieceBook, piece_digests
from preheat.store.layout import Layout

__all__ = ["PeerServer"]

_ROUTE = re.compile(r"^sha256:([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class PeerServer:
    """Serves one node's store to peers (see the module docstring)."""

    def __init__(
        self,
        layout: Layout,
        token: str,
        book: PieceBook | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if len(token) < 16:
            raise ValueError("the cluster token must be at least 16 characters")
        self.layout = layout
        self.book = book or PieceBook()
        self.host = host
        self.port = port
        self._token = token.encode()
        self._runner: web.AppRunner | None = None
        self._lists: dict[str, list[str]] = {}
        #: Transfers in flight (bodies being sent).
        self.serving = 0
        #: Bytes of blob bodies sent, and requests refused for a missing/bad token.
        self.bytes_served = 0
        self.unauthorized = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_route("GET", "/blobs/{ref}", self._blob)
        app.router.add_route("HEAD", "/blobs/{ref}", self._blob)
        app.router.add_route("GET", "/blobs/{ref}/pieces", self._pieces)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=0.5
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()

    async def stop(self) -> None:
        """Stop serving; transfers in flight are cut (receivers retry elsewhere)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.encode(), self._token):
            self.unauthorized += 1
            return web.Response(
                status=401,
                text="a cluster token is required (Authorization: Bearer ...)\n",
                headers={"WWW-Authenticate": 'Bearer realm="preheat-peers"'},
            )
        return await handler(request)

    def _digest(self, request: web.Request) -> str:
        m = _ROUTE.match(request.match_info["ref"])
        if m is None:
            raise web.HTTPNotFound(text="blobs are addressed as sha256:<64 hex>\n")
        return m.group(1)

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        digest = self._digest(request)
        path = self.layout.blob(digest)
        if not path.exists():
            partial = self.book.get(digest)
            if partial is None:
                raise web.HTTPNotFound(text="this node does not hold that blob\n")
            start, end = _parse_range(request.headers.get("Range"), partial.size)
            if not partial.covers(start, end):
                raise web.HTTPRequestRangeNotSatisfiable(
                    text="those bytes are not verified on this node yet\n"
                )
            part = self.layout.tmp / f"{digest}.part"
            with contextlib.suppress(FileNotFoundError):
                return await self._send(request, part, start, end, partial.size)
            if not path.exists():  # not published either: the fill was abandoned
                raise web.HTTPNotFound(text="this node does not hold that blob\n")
        size = os.stat(path).st_size
        start, end = _parse_range(request.headers.get("Range"), size)
        return await self._send(request, path, start, end, size)

    async def _send(
        self, request: web.Request, path: Path, start: int, end: int, size: int
    ) -> web.StreamResponse:
        """Bytes [start, end) of the file by sendfile(2) (as aiohttp's FileResponse
        does), counted in ``serving`` while they go out."""
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the transfer
        try:
            resp = web.StreamResponse(status=206 if "Range" in request.headers else 200)
            resp.content_length = end - start
            resp.headers["Accept-Ranges"] = "bytes"
            resp.headers["X-Preheat-Serving"] = str(self.serving)
            if resp.status == 206:
                resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            self.serving += 1
            try:
                writer = await resp.prepare(request)
                if request.method == "HEAD":
                    return resp
                assert writer is not None
                await writer.drain()
                transport = request.transport
                if transport is None:
                    raise ConnectionResetError("peer went away")
                loop = asyncio.get_running_loop()
                try:
                    await loop.sendfile(transport, f, start, end - start)
                except NotImplementedError:
                    pos = start
                    while pos < end:
                        data = await loop.run_in_executor(
                            None, os.pread, f.fileno(), min(1 << 20, end - pos), pos
                        )
                        if not data:
                            break
                        await resp.write(data)
                        pos += len(data)
                await resp.write_eof()
                self.bytes_served += end - start
                return resp
            finally:
                self.serving -= 1
        finally:
            f.close()

    async def _pieces(self, request: web.Request) -> web.Response:
        digest = self._digest(request)
        path = self.layout.blob(digest)
        if path.exists():
            digests = self._lists.get(digest)
            if digests is None:
                size = os.stat(path).st_size
                digests = await asyncio.to_thread(piece_digests, path, size, PIECE_SIZE)
                self._lists[digest] = digests
            size = os.stat(path).st_size
            return web.json_response(
                {
                    "size": size,
                    "piece": PIECE_SIZE,
                    "digests": digests,
                    "complete": True,
                    "have": list(range(len(digests))),
                }
            )
        partial = self.book.get(digest)
        if partial is None:
            raise web.HTTPNotFound(text="this node does not hold that blob\n")
        return web.json_response(
            {
                "size": partial.size,
                "piece": partial.piece,
                "digests": list(partial.digests),
                "complete": False,
                "have": sorted(partial.verified),
            }
        )


def _parse_range(header: str | None, size: int) -> tuple[int, int]:
    """[start, end) of one ``bytes=`` range (the whole blob without a header)."""
    if header is None:
        return 0, size
    m = _RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        raise web.HTTPRequestRangeNotSatisfiable(text="one bytes=a-b range per request\n")
    if not m.group(1):  # suffix: the last n bytes
        n = int(m.group(2))
        start, end = max(0, size - n), size
    else:
        start = int(m.group(1))
        end = min(size, int(m.group(2)) + 1) if m.group(2) else size
    if start >= end or start >= size:
        raise web.HTTPRequestRangeNotSatisfiable(
            text=f"range {header} is outside the blob's {size} bytes\n",
            headers={"Content-Range": f"bytes */{size}"},
        )
    return start, end
