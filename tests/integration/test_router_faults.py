"""Router fault suite: a real ``preheat router serve`` process in front of engines that fail.

The engines here are small raw HTTP/1.1 servers (``RawEngine``, a thread of their own)
that can stream faster than anyone reads, drip one byte a second, hang or crash; the
router is always a separate process, so its memory is read from /proc/PID/status and
its log file is grepped. Other test_router_* files import these helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from preheat.testing.routers import RouterProcess, launch_router, start_fast_backend

TOKEN = "fault-suite-token"
# A POST handler gets the body and the writer; it writes a whole HTTP response.
PostHandler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


# --- helpers ------------------------------------------------------------------------------


def post(url: str, body: Any, *, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """POST JSON (or raw bytes); returns (status, headers, body) for any status."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def get_text(url: str, token: str | None = None) -> str:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent); labels must all match."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def rss_kb(pid: int) -> int:
    """Resident memory of a process in KiB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def write_config(path: Path, instances: list[str], **top: Any) -> Path:
    variant = top.pop("variant", {})
    doc = {
        "variants": [{"name": "default", "instances": instances, **variant}],
        "health": top.pop("health", {"interval_s": 0.2, "timeout_s": 1.0, "failures": 2}),
        **top,
    }
    path.write_text(json.dumps(doc))
    return path


@contextlib.contextmanager
def router_for(
    tmp_path: Path, instances: list[str], *, decision_log: Path | None = None, **top: Any
) -> Iterator[RouterProcess]:
    """A router process over ``instances`` (config file, admin token, log file)."""
    cfg = write_config(tmp_path / "router.json", instances, **top)
    r = launch_router(
        config=cfg,
        admin_token=TOKEN,
        decision_log=decision_log,
        log_path=tmp_path / "router.log",
    )
    try:
        yield r
    finally:
        r.stop()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            length = int(v)
    body = await reader.readexactly(length) if length else b""
    return lines[0].split(" ")[0], body


class RawEngine:
    """An HTTP/1.1 server in its own thread: ``GET`` answers 200 ``{}`` (health, models),
    ``POST`` is handed to ``on_post``. ``sent`` counts body bytes the handlers wrote."""

    def __init__(self, on_post: PostHandler) -> None:
        self.on_post = on_post
        self.sent = 0
        self.posts = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, body = await _read_request(reader)
                if method == "GET":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    await writer.drain()
                    continue
                self.posts += 1
                await self.on_post(body, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

        self._loop.run_until_complete(main())
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    def __enter__(self) -> RawEngine:
        self._thread.start()
        assert self._ready.wait(10), "the raw engine did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def sse_head(chunked: bool = True) -> bytes:
    te = b"Transfer-Encoding: chunked\r\n" if chunked else b"Connection: close\r\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + te + b"\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def open_stream(url: str, body: dict[str, Any], rcvbuf: int = 65536) -> socket.socket:
    """Send a POST through a raw socket with a small receive buffer (a slow client)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return s


# --- defect 8: slow clients, full disks, live config ----------------------------------------


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "until-close"])
def test_a_slow_client_does_not_make_the_router_buffer_the_stream(
    tmp_path: Path, chunked: bool
) -> None:
    """An engine streams 150 MB as fast as it can to a client that stops reading: the
    router pauses reading the engine, so its RSS grows by far less than the stream."""
    total = 150 * 1024 * 1024
    piece = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"

    async def flood(body: bytes, writer: asyncio.StreamWriter) -> None:
        if not json.loads(body).get("stream"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            return
        writer.write(sse_head(chunked))
        while engine.sent < total:
            writer.write(chunk(piece) if chunked else piece)
            engine.sent += len(piece)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    with RawEngine(flood) as engine, router_for(tmp_path, [engine.url]) as r:
        post(r.url + "/v1/completions", {"prompt": "warm", "stream": False}, timeout=5)
        engine.sent = 0
        before = rss_kb(r.pid)
        s = open_stream(r.url, {"prompt": "x", "stream": True})
        try:
            got = 0
            while got < 1024 * 1024:
                got += len(s.recv(65536))
            time.sleep(3.0)  # the client stops reading; a naive router keeps buffering
            grown_mb = (rss_kb(r.pid) - before) / 1024
            sent_mb = engine.sent / 2**20
        finally:
            s.close()
        assert grown_mb < 30, f"router RSS grew {grown_mb:.0f} MB (engine sent {sent_mb:.0f} MB)"
        assert sent_mb < 100, f"the engine was never paused: it sent {sent_mb:.0f} MB"
        # The router is still fine, and the aborted stream left nothing in flight.
        status, _, _ = post(r.url + "/v1/completions", {"prompt": "after"}, timeout=10)
        assert status == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = get_text(r.url + "/metrics")
            if metric(m, "preheat_router_in_flight") == 0:
                break
            time.sleep(0.1)
        assert metric(m, "preheat_router_in_flight") == 0


def test_a_full_disk_under_the_decision_log_never_fails_a_request(tmp_path: Path) -> None:
    """With the decision log on a full 64 KiB tmpfs every request still succeeds; a metric
    counts the dropped records and the router warns once, not per request."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        with start_fast_backend() as backend:
            log = mnt / "decisions.jsonl"
            log.touch()
            with contextlib.suppress(OSError), (mnt / "filler").open("wb") as f:
                for _ in range(1000):
                    f.write(b"\0" * 4096)
                    f.flush()
            with router_for(tmp_path, [backend.url], decision_log=log) as r:
                for i in range(10):
                    status, _, _ = post(r.url + "/v1/completions", {"prompt": f"q{i}"})
                    assert status == 200
                    status, _, body = post(
                        r.url + "/v1/completions", {"prompt": f"s{i}", "stream": True}
                    )
                    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
                m = get_text(r.url + "/metrics")
                assert metric(m, "preheat_router_decision_log_dropped_total") == 20
            text = (tmp_path / "router.log").read_text()
            assert text.count("decision log") == 1, text
            assert "No space left" in text
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_put_config_applies_timeouts_live_and_refuses_restart_only_fields(
    tmp_path: Path,
) -> None:
    """A new upstream_timeout_s takes effect on the next request; a new max_body_bytes is
    refused with 400 naming it as restart-only, and the old config stays."""
    with start_fast_backend() as backend, router_for(tmp_path, [backend.url]) as r:
        doc = r.admin("GET", "/admin/config")
        assert doc["upstream_timeout_s"] == 300
        new = json.loads(json.dumps(doc))
        new["upstream_timeout_s"] = 0.5
        new["connect_timeout_s"] = 2.0
        assert r.admin("PUT", "/admin/config", new)["upstream_timeout_s"] == 0.5
        t0 = time.monotonic()
        status, _, body = post(
            r.url + "/v1/completions", {"prompt": "x", "preheat_test": {"hang_s": 4}}
        )
        took = time.monotonic() - t0
        assert status == 504, body
        assert took < 3.0
        assert json.loads(body)["error"]["type"] == "upstream_timeout"
        bad = json.loads(json.dumps(new))
        bad["max_body_bytes"] = 4096
        with pytest.raises(urllib.error.HTTPError) as info:
            r.admin("PUT", "/admin/config", bad)
        with info.value as err:
            assert err.code == 400
            message = json.loads(err.read())["error"]["message"]
        assert "max_body_bytes" in message and "restart" in message
        now = r.admin("GET", "/admin/config")
        assert now["max_body_bytes"] == doc["max_body_bytes"]
        assert now["upstream_timeout_s"] == 0.5
