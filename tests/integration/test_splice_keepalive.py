"""The splice(2) ranged GET's keep-alive pool against a real HTTP server on 127.0.0.1
that closes its sockets after each answer, as a restarted peer or an idle timeout does."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from preheat.errors import OriginUnavailable
from preheat.sources import _splice

BODY = bytes(range(256)) * 64  # 16 KiB


async def _server(answer: bool) -> tuple[asyncio.Server, list[int]]:
    """A server that answers one ranged GET per connection (``answer``), or none, and then
    closes the socket without saying ``Connection: close``; counts connections."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(1)
        head = await reader.readuntil(b"\r\n\r\n")
        if answer:
            rng = next(x for x in head.decode().split("\r\n") if x.lower().startswith("range:"))
            a, b = (int(v) for v in rng.split("=", 1)[1].split("-"))
            part = BODY[a : b + 1]
            writer.write(
                f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(part)}\r\n"
                f"Content-Range: bytes {a}-{b}/{len(BODY)}\r\n\r\n".encode()
                + part
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


async def test_a_pooled_socket_the_server_closed_is_replaced_not_a_failure(tmp_path: Path) -> None:
    """Every GET after the first finds its pooled socket closed by the server: each still
    lands its exact bytes, on a fresh connection (one per GET), with no error."""
    server, seen = await _server(answer=True)
    port = server.sockets[0].getsockname()[1]
    pool = _splice.SplicePool("127.0.0.1", port)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        for start, end in ((0, 4096), (4096, 10000), (10000, len(BODY))):
            await pool.get_range("/blob", start, end, fd, lambda _o, _n: None, "peer x")
            await asyncio.sleep(0.05)  # the server's close reaches the pooled socket
        assert os.pread(fd, len(BODY), 0) == BODY
        assert len(seen) == 3
    finally:
        os.close(fd)
        pool.close()
        server.close()
        await server.wait_closed()


async def test_a_fresh_socket_closed_before_the_answer_fails_once(tmp_path: Path) -> None:
    """A server that closes a new connection without answering is an unavailable peer:
    ``OriginUnavailable`` after one connection, not a retry loop."""
    server, seen = await _server(answer=False)
    port = server.sockets[0].getsockname()[1]
    pool = _splice.SplicePool("127.0.0.1", port)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(OriginUnavailable, match="closed before the response"):
            await pool.get_range("/blob", 0, 4096, fd, lambda _o, _n: None, "peer x")
        assert len(seen) == 1
    finally:
        os.close(fd)
        pool.close()
        server.close()
        await server.wait_closed()
