"""The router's raw-protocol front (router/front.py) through real sockets: keep-alive and
pipelining, chunked bodies, ``Expect: 100-continue``, refused requests, SSE passed on
byte for byte, a client that disconnects mid-stream, and the routes relayed to aiohttp."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from preheat.testing.routers import RouterProcess, start_fast_backend
from tests.integration.test_router_faults import (
    TOKEN,
    RawEngine,
    _read_request,
    in_flight,
    router_for,
)

LIMIT = 4096


def _connect(r: RouterProcess) -> tuple[socket.socket, BinaryIO]:
    s = socket.create_connection(("127.0.0.1", r.port), timeout=10)
    return s, s.makefile("rb")


def _read(f: BinaryIO, *, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One response from a raw socket: status, headers (lower-case names), body (chunked
    decoded; none after a HEAD)."""
    status_line = f.readline()
    assert status_line.startswith(b"HTTP/1."), status_line
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    if head:
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, f.read(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(f.readline().split(b";")[0], 16)) > 0:
            body += f.read(size)
            assert f.read(2) == b"\r\n"
        assert f.readline() == b"\r\n"
        return status, headers, body
    return status, headers, f.read()


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _metric(r: RouterProcess, name: str, **labels: str) -> float:
    s, f = _connect(r)
    with s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
        text = _read(f)[2].decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name) and want in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def fast_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("front")
    with start_fast_backend() as b, router_for(tmp, [b.url], max_body_bytes=LIMIT) as r:
        yield r


def test_pipelined_keep_alive_requests_are_answered_in_order(fast_router: RouterProcess) -> None:
    """Five requests written at once on one connection (proxied and relayed mixed) come
    back in order, each body byte for byte; ``Connection: close`` ends the connection;
    a burst of 40 is answered in order too."""
    bodies = [json.dumps({"prompt": f"p{i}", "max_tokens": 1}).encode() for i in range(3)]
    wire = (
        _post("/v1/completions", bodies[0])
        + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
        + _post("/v1/chat/completions", bodies[1])
        + b"GET /v1/models?x=1 HTTP/1.1\r\nHost: r\r\n\r\n"
        + _post("/v1/completions", bodies[2], "Connection: close\r\n")
    )
    s, f = _connect(fast_router)
    with s:
        s.sendall(wire)
        answers = [_read(f) for _ in range(5)]
        assert f.read() == b""  # closed after the last one
    assert [a[0] for a in answers] == [200] * 5
    for i, k in ((0, 0), (2, 1), (4, 2)):
        assert json.loads(answers[i][2])["body_sha256"] == hashlib.sha256(bodies[k]).hexdigest()
        assert answers[i][1]["x-preheat-instance"].startswith("http://127.0.0.1:")
    assert json.loads(answers[1][2])["status"] == "ok"
    burst = [json.dumps({"prompt": f"b{i}", "max_tokens": 1}).encode() for i in range(40)]
    s, f = _connect(fast_router)
    with s:  # more than MAX_PIPELINED at once: reading pauses, nothing is lost or reordered
        s.sendall(b"".join(_post("/v1/completions", b) for b in burst))
        got = [json.loads(_read(f)[2])["body_sha256"] for _ in burst]
    assert got == [hashlib.sha256(b).hexdigest() for b in burst]
    assert json.loads(answers[3][2])["data"][0]["id"] == "fake"
    assert answers[4][1]["connection"] == "close"


def test_chunked_bodies_and_expect_continue(fast_router: RouterProcess) -> None:
    """A chunked request body reaches the instance decoded; ``Expect: 100-continue`` gets
    ``100 Continue`` before the body is sent; an HTTP/1.0 request is answered and closed."""
    body = json.dumps({"prompt": "chunked " * 50, "max_tokens": 1}).encode()
    pieces = [body[:7], body[7:100], body[100:]]
    chunked = b"".join(b"%x;ext=1\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    s, f = _connect(fast_router)
    with s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked
        )
        status, _, out = _read(f)
        assert status == 200
        assert json.loads(out)["body_sha256"] == hashlib.sha256(body).hexdigest()
    s, f = _connect(fast_router)
    with s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert f.readline() == b"\r\n"
        s.sendall(body)
        status, _, out = _read(f)
        assert status == 200 and json.loads(out)["body_sha256"] == hashlib.sha256(body).hexdigest()
    s, f = _connect(fast_router)
    with s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        status, _, out = _read(f)
        assert status == 200 and json.loads(out)["status"] == "ok"
        assert f.read() == b""


@pytest.mark.parametrize(
    ("wire", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", 431),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", 413),
        (
            b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"800\r\n" + b"x" * 2048 + b"\r\n") * 3,
            413,
        ),
    ],
    ids=["garbage", "two-lengths", "long-target", "many-headers", "big-length", "big-chunked"],
)
def test_bad_requests_are_refused_and_the_connection_closed(
    fast_router: RouterProcess, wire: bytes, status: int
) -> None:
    """Unparseable, oversized-head and oversized-body requests get their status in the
    OpenAI error format with ``Connection: close``, counted in preheat_router_rejected."""
    before = _metric(fast_router, "preheat_router_rejected_total", status=str(status))
    s, f = _connect(fast_router)
    with s:
        s.sendall(wire)
        got, headers, body = _read(f)
        assert f.read() == b""
    assert got == status and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == status
    if status == 413:
        assert f"{LIMIT} bytes" in json.loads(body)["error"]["message"]
    after = _metric(fast_router, "preheat_router_rejected_total", status=str(status))
    assert after == before + 1


def test_relayed_routes_and_a_live_strategy_switch(fast_router: RouterProcess) -> None:
    """Admin (token checked), metrics, HEAD, 404 and 405 are aiohttp's answers on the same
    port; a strategy switched through the admin API applies to the next proxied request."""
    s, f = _connect(fast_router)
    with s:
        s.sendall(b"GET /admin/config HTTP/1.1\r\nHost: r\r\n\r\n")
        assert _read(f)[0] == 401
        patch = json.dumps({"strategy": "least_outstanding"}).encode()
        s.sendall(
            f"PATCH /admin/variants/default HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer "
            f"{TOKEN}\r\nContent-Length: {len(patch)}\r\n\r\n".encode()
            + patch
        )
        status, _, out = _read(f)
        assert status == 200 and json.loads(out)["variants"][0]["strategy"] == "least_outstanding"
        s.sendall(_post("/v1/completions", b'{"prompt": "x"}'))
        status, headers, _ = _read(f)
        assert status == 200 and headers["x-preheat-outcome"] != "random"
        s.sendall(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
        status, headers, _ = _read(f, head=True)  # no body follows a HEAD answer
        assert status == 200 and int(headers["content-length"]) > 0
        s.sendall(b"GET /nowhere HTTP/1.1\r\nHost: r\r\n\r\nGET /v1/completions HTTP/1.1\r\n\r\n")
        assert [_read(f)[0], _read(f)[0]] == [404, 405]
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
        assert b"preheat_router_decisions_total" in _read(f)[2]
        s.sendall(
            b"PATCH /admin/variants/default HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b'\r\nContent-Length: 23\r\n\r\n{"strategy": "random"}'
            + b" "
        )
        assert _read(f)[0] == 200


class SSEEngine(RawEngine):
    """Odd-shaped SSE: close-delimited, events split and joined across writes. A request
    for 'hold' gets one event and then nothing: the engine waits for the router to hang
    up and notes when (``hangups``)."""

    def __init__(self) -> None:
        super().__init__(self._unused)
        self.hangups: list[float] = []

    async def _unused(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        raise AssertionError("SSEEngine answers in _handle")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, body = await _read_request(reader)
                if method == "GET":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b'Connection: close\r\n\r\ndata: {"a": 1}\n\n'
                )
                await writer.drain()
                if b"hold" in body:
                    await asyncio.wait_for(reader.read(), 30)  # b"" once the router hangs up
                    self.hangups.append(time.monotonic())
                    return
                await asyncio.sleep(0.3)
                writer.write(b"data: \xc3\xa9\r\n\r\ndata: [DO")
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(b"NE]\n\n")
                await writer.drain()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_sse_passes_through_byte_for_byte_and_a_disconnect_cancels_upstream(
    tmp_path: Path,
) -> None:
    """An SSE answer reaches the client byte for byte, the first event before the instance
    sends the next; a client that hangs up mid-stream frees the request at once (the
    instance's connection is closed) although the instance would go on for 30 s."""
    with SSEEngine() as engine, router_for(tmp_path, [engine.url]) as r:
        s, f = _connect(r)
        with s:
            s.sendall(_post("/v1/completions", b'{"prompt": "a", "stream": true}'))
            head = f.readline() + b"".join(iter(lambda: f.readline(), b"\r\n"))
            assert b"text/event-stream" in head and b"chunked" in head.lower()
            t0 = time.monotonic()
            size = int(f.readline(), 16)
            first = f.read(size + 2)[:-2]
            assert first == b'data: {"a": 1}\n\n' and time.monotonic() - t0 < 0.25
            f2 = s.makefile("rb")
            s.settimeout(10)
            rest = b""
            while (size := int(f2.readline(), 16)) > 0:
                rest += f2.read(size + 2)[:-2]
        assert rest == b"data: \xc3\xa9\r\n\r\ndata: [DONE]\n\n"
        s, f = _connect(r)
        s.sendall(_post("/v1/completions", b'{"prompt": "hold", "stream": true}'))
        assert f.readline().startswith(b"HTTP/1.1 200")
        while f.readline() != b"\r\n":
            pass
        assert b'"a": 1' in f.read(int(f.readline(), 16))
        assert sum(in_flight(r).values()) == 1
        f.close()  # the socket's file keeps it open until closed too
        s.close()
        closed = time.monotonic()
        deadline = closed + 5
        while sum(in_flight(r).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(in_flight(r).values()) == 0
        while not engine.hangups and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.hangups and engine.hangups[0] - closed < 5
