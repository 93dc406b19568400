"""The router's lean upstream HTTP/1.1 client against raw TCP servers on 127.0.0.1.

Each server answers with exact bytes, so the framing cases an engine may send are all
covered: Content-Length, chunked with extensions and trailers, a body that ends when
the connection closes, responses split into one-byte writes, ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from preheat.router.upstream import UpstreamPool
from preheat.router.upstream_errors import ConnectFailed, Disconnected

Reply = Callable[[bytes], list[bytes]]


@contextlib.asynccontextmanager
async def raw_server(
    reply: Reply, *, close_after: bool = False, trickle: bool = False
) -> AsyncIterator[tuple[str, list[bytes], list[int]]]:
    """A server that reads one request head + body, then writes ``reply(request)``.

    Yields (origin, requests seen, connection count)."""
    seen: list[bytes] = []
    conns = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                seen.append(head + body)
                for piece in reply(head + body):
                    if trickle:
                        for i in range(len(piece)):
                            writer.write(piece[i : i + 1])
                            await writer.drain()
                    else:
                        writer.write(piece)
                        await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen, conns
    finally:
        server.close()
        await server.wait_closed()


def _json_reply(req: bytes) -> list[bytes]:
    body = b'{"ok": true}'
    return [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n",
        b"Content-Length: 12\r\n\r\n" + body,
    ]


async def test_content_length_bodies_reuse_one_connection() -> None:
    """The request goes out byte for byte with the headers; the connection is kept."""
    async with raw_server(_json_reply) as (origin, seen, conns):
        pool = UpstreamPool(connect_timeout=2, read_timeout=2)
        for _ in range(3):
            async with await pool.post(
                origin,
                "/v1/completions",
                b'{"prompt":"hi"}',
                {"X-Request-Id": "r1", "X-Note": "h\u00e9llo"},
            ) as resp:
                assert resp.status == 200
                assert resp.headers["content-type"] == "application/json"
                assert await resp.read() == b'{"ok": true}'
        await pool.close()
    assert conns[0] == 1
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-Request-Id: r1\r\n" in seen[0]
    assert "X-Note: h\u00e9llo".encode() in seen[0]
    assert seen[0].endswith(b'Content-Length: 15\r\n\r\n{"prompt":"hi"}')


async def test_chunked_with_extensions_and_trailers_arrives_decoded_in_order() -> None:
    """Chunked transfer coding is decoded, also when it arrives one byte at a time."""

    def reply(req: bytes) -> list[bytes]:
        return [
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n",
            b"6;ext=1\r\ndata: \r\n",
            b"b\r\nhello world\r\n",
            b"0\r\nX-Trailer: t\r\n\r\n",
        ]

    for trickle in (False, True):
        async with raw_server(reply, trickle=trickle) as (origin, _, conns):
            pool = UpstreamPool(connect_timeout=2, read_timeout=2)
            for _ in range(2):
                async with await pool.post(origin, "/v1/completions", b"{}", {}) as resp:
                    pieces = [p async for p in resp.iter_any()]
                assert b"".join(pieces) == b"data: hello world"
            await pool.close()
        assert conns[0] == 1  # fully read chunked responses keep the connection


async def test_a_body_without_length_ends_at_close_and_is_not_reused() -> None:
    """HTTP/1.0-style: the close ends the body; Connection: close is not pooled."""

    def reply(req: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"part one, ", b"part two"]

    async with raw_server(reply, close_after=True) as (origin, _, conns):
        pool = UpstreamPool(connect_timeout=2, read_timeout=2)
        for _ in range(2):
            async with await pool.post(origin, "/v1/completions", b"{}", {}) as resp:
                assert await resp.read() == b"part one, part two"
        await pool.close()
    assert conns[0] == 2


async def test_silence_times_out_and_a_cut_body_is_a_disconnect() -> None:
    """No byte within read_timeout -> TimeoutError; a short body -> Disconnected."""
    async with raw_server(lambda req: []) as (origin, _, _c):
        pool = UpstreamPool(connect_timeout=2, read_timeout=0.2)
        with pytest.raises(TimeoutError):
            await pool.post(origin, "/v1/completions", b"{}", {})
        await pool.close()

    def short(req: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"]

    async with raw_server(short, close_after=True) as (origin, _, _c):
        pool = UpstreamPool(connect_timeout=2, read_timeout=2)
        async with await pool.post(origin, "/v1/completions", b"{}", {}) as resp:
            with pytest.raises(Disconnected, match="mid-response"):
                await resp.read()
        await pool.close()


async def test_a_refused_connection_is_connect_failed() -> None:
    """Nothing listens -> ConnectFailed naming the origin."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    pool = UpstreamPool(connect_timeout=2, read_timeout=2)
    with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
        await pool.post(f"http://127.0.0.1:{port}", "/v1/completions", b"{}", {})
    await pool.close()
