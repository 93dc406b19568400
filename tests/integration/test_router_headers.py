"""Response headers an instance sends reach the client through ``preheat router serve``,
every value of a repeated header kept (two ``Set-Cookie``, repeated ``Vary`` and
``Link``), hop-by-hop and framing headers left out, on both fronts and on every route
whose answer comes from an instance: the two proxy routes (whole and streamed) and
``/v1/models`` (which the raw front relays to its aiohttp application)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import BinaryIO

import pytest

from preheat.testing.routers import launch_router
from tests.integration.test_router_faults import RawEngine

REPEATED = (
    b"Set-Cookie: a=1; Path=/\r\nSet-Cookie: b=2; Path=/\r\n"
    b"Vary: Accept\r\nVary: Origin\r\n"
    b"Link: <https://x/1>; rel=preload\r\nLink: <https://x/2>; rel=preload\r\n"
    b"Connection: keep-alive, X-Hop\r\nX-Hop: dropped\r\nKeep-Alive: timeout=5\r\n"
)


class HeaderEngine(RawEngine):
    """Answers every request with the ``REPEATED`` headers: ``/v1/models`` and a plain
    completion with ``Content-Length``, a streamed one chunked."""

    def __init__(self) -> None:
        super().__init__(self._unused)

    async def _unused(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        raise AssertionError("HeaderEngine answers in _handle")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *rest = head.decode("latin-1").split("\r\n")
                length = sum(
                    int(h.partition(":")[2]) for h in rest if h.lower().startswith("content-length")
                )
                body = await reader.readexactly(length) if length else b""
                if line.startswith("GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                elif b'"stream": true' in body:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                        + REPEATED
                        + b"Transfer-Encoding: chunked\r\n\r\n"
                        + b"6\r\ndata: \r\n2\r\n\n\n\r\n0\r\n\r\n"
                    )
                else:
                    out = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        + REPEATED
                        + b"Content-Length: %d\r\n\r\n" % len(out)
                        + out
                    )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _answer(f: BinaryIO) -> tuple[int, list[tuple[str, str]], bytes]:
    """One response: status, headers in order (lower-case names, repeats kept), body."""
    status = int(f.readline().split()[1])
    headers = []
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers.append((k.strip().lower(), v.strip()))
    names = [k for k, _ in headers]
    if "content-length" in names:
        return status, headers, f.read(int(dict(headers)["content-length"]))
    body = b""
    while (size := int(f.readline(), 16)) > 0:
        body += f.read(size)
        f.read(2)
    f.readline()
    return status, headers, body


@pytest.mark.parametrize("front", ["raw", "aiohttp"])
def test_repeated_response_headers_reach_the_client_on_both_fronts(
    tmp_path: Path, front: str
) -> None:
    """Each route answered from an instance keeps both ``Set-Cookie``, ``Vary`` and
    ``Link`` values in order, drops ``Connection``, ``Keep-Alive`` and the header
    ``Connection`` names, and has exactly one framing header and the router's own."""
    with HeaderEngine() as engine:
        r = launch_router(
            backends=[engine.url],
            extra_args=["--front", front],
            log_path=tmp_path / "router.log",
        )
        try:
            s = socket.create_connection(("127.0.0.1", r.port), timeout=10)
            f = s.makefile("rb")
            with s:
                for request, stream in (
                    (b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n", False),
                    (b'{"prompt": "x"}', False),
                    (b'{"prompt": "x", "stream": true}', True),
                ):
                    if not request.startswith(b"GET"):
                        request = (
                            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(request) + request
                        )
                    s.sendall(request)
                    status, headers, body = _answer(f)
                    assert status == 200, (request, body)

                    def got(name: str, headers: list[tuple[str, str]] = headers) -> list[str]:
                        return [v for k, v in headers if k == name]

                    assert got("set-cookie") == ["a=1; Path=/", "b=2; Path=/"], headers
                    assert got("vary") == ["Accept", "Origin"], headers
                    assert len(got("link")) == 2, headers
                    assert got("x-hop") == [] and got("keep-alive") == [], headers
                    assert got("connection") in ([], ["keep-alive"]), headers
                    framing = got("content-length") + got("transfer-encoding")
                    assert len(framing) == 1, headers
                    assert len(got("content-type")) == 1 and len(got("date")) == 1, headers
                    if stream:
                        assert body == b"data: \n\n" and got("content-type") == [
                            "text/event-stream"
                        ]
                    elif b"/v1/models" not in request:
                        assert got("x-preheat-instance") == [engine.url], headers
        finally:
            r.stop()
