"""Router fault suite: a real ``preheat router serve`` process in front of engines that fail.

The engines here are small raw HTTP/1.1 servers (``RawEngine``, a thread of their own)
that can stream faster than anyone reads, drip one byte a second, hang or crash; the
router is always a separate process, so its memory is read from /proc/PID/status and
its log file is grepped. test_router_defects.py and test_router_security.py import
these helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
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

    def __init__(self, on_post: PostHandler, ssl: Any = None) -> None:
        self.on_post = on_post
        self.ssl = ssl
        self.sent = 0
        self.posts = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://127.0.0.1:{self.port}"

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
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl)
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


def self_signed(tmp_path: Path) -> tuple[Any, Path]:
    """A TLS server context for 127.0.0.1 and the certificate file a client must trust."""
    import datetime
    import ipaddress
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "engine.crt", tmp_path / "engine.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_path, key_path)
    return ctx, cert_path


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


# --- the fault suite: crash, hang, drip, restart, storm, many prefixes ----------------------


def in_flight(r: RouterProcess) -> dict[str, float]:
    """preheat_router_in_flight per instance, from the router's /metrics."""
    out = {}
    for line in get_text(r.url + "/metrics").splitlines():
        if line.startswith("preheat_router_in_flight{"):
            head, _, value = line.rpartition(" ")
            out[head.split('instance="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def wait_idle(r: RouterProcess, timeout: float = 10.0) -> dict[str, float]:
    """Poll until no request is in flight; returns the last reading."""
    deadline = time.monotonic() + timeout
    counts = in_flight(r)
    while any(counts.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        counts = in_flight(r)
    return counts


def read_sse(s: socket.socket, timeout: float) -> bytes:
    """Everything the router sends on a raw socket until it closes or ``timeout`` passes."""
    s.settimeout(timeout)
    parts = []
    with contextlib.suppress(TimeoutError, ConnectionError):
        while data := s.recv(65536):
            parts.append(data)
            if b"0\r\n\r\n" in parts[-1][-16:]:
                break
    return b"".join(parts)


def test_an_engine_killed_mid_stream(tmp_path: Path) -> None:
    """SIGKILL a simulated engine while it streams: the client's stream ends with an error
    event, the engine is marked unhealthy, nothing stays in flight, the next requests go
    to the other engine."""
    from preheat.testing.engines import simulated_engines

    with (
        simulated_engines(2, profile="tiny", time_scale=5.0) as engines,
        router_for(tmp_path, [e.url for e in engines]) as r,
    ):
        s = open_stream(r.url, {"prompt": "hello " * 50, "max_tokens": 400, "stream": True})
        try:
            s.settimeout(10)
            head = s.recv(65536)
            while b"data: " not in head:
                head += s.recv(65536)
            victim = head.split(b"X-Preheat-Instance: ", 1)[1].split(b"\r\n", 1)[0].decode()
            engine = next(e for e in engines if e.url == victim)
            engine.proc.kill()
            engine.proc.wait(10)
            rest = read_sse(s, 10)
        finally:
            s.close()
        assert b"event: error" in rest and b"failed mid-stream" in rest
        assert wait_idle(r) == {e.url: 0.0 for e in engines}
        states = {
            i["url"]: i["state"]
            for i in r.admin("GET", "/admin/config")["variants"][0]["instances"]
        }
        assert states[victim] == "unhealthy"
        for _ in range(5):
            status, headers, _ = post(r.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 200 and headers["X-Preheat-Instance"] != victim


def test_a_hanging_engine_gets_a_504_and_frees_its_slot(tmp_path: Path) -> None:
    """An engine that reads the request and never answers: 504 after upstream_timeout_s,
    in flight back to 0, and the router answers other requests meanwhile."""
    release = threading.Event()

    async def hang(body: bytes, writer: asyncio.StreamWriter) -> None:
        while not release.is_set():
            await asyncio.sleep(0.05)
        writer.close()

    with RawEngine(hang) as engine, router_for(tmp_path, [engine.url], upstream_timeout_s=1.0) as r:
        try:
            t0 = time.monotonic()
            status, _, body = post(r.url + "/v1/completions", {"prompt": "x"})
            took = time.monotonic() - t0
            assert status == 504 and json.loads(body)["error"]["type"] == "upstream_timeout"
            assert 0.9 < took < 5
            assert wait_idle(r) == {engine.url: 0.0}
            assert "preheat_router_upstream_errors_total" in get_text(r.url + "/metrics")
        finally:
            release.set()


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_a_slow_drip_engine_is_cut_off_by_the_read_timeout(tmp_path: Path, stream: bool) -> None:
    """An engine that sends one byte per second: with upstream_timeout_s 0.5 the client gets
    a clear timeout error (an SSE error event, or 504) and nothing stays in flight."""

    async def drip(body: bytes, writer: asyncio.StreamWriter) -> None:
        if stream:
            writer.write(sse_head(chunked=False))
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            )
        for _ in range(30):
            writer.write(b"d" if stream else b" ")
            await writer.drain()
            await asyncio.sleep(1.0)
        writer.close()

    with RawEngine(drip) as engine, router_for(tmp_path, [engine.url], upstream_timeout_s=0.5) as r:
        t0 = time.monotonic()
        status, _, body = post(r.url + "/v1/completions", {"prompt": "x", "stream": stream})
        took = time.monotonic() - t0
        assert took < 10
        if stream:
            assert status == 200
            assert b"event: error" in body and b"(timeout)" in body
        else:
            assert status == 504 and b"did not finish within 0.5 s" in body
        assert wait_idle(r) == {engine.url: 0.0}


def test_a_router_restart_under_load_fails_only_what_was_in_flight(tmp_path: Path) -> None:
    """SIGKILL the router under steady load and start it again on the same port: the only
    failures are connection errors while it is down (never an HTTP error), and after the
    restart every request succeeds."""
    results: list[tuple[float, str]] = []  # (time, "ok" | "conn" | "http <status>")
    stop = threading.Event()

    with start_fast_backend() as b1, start_fast_backend() as b2:
        cfg = write_config(tmp_path / "router.json", [b1.url, b2.url])
        r = launch_router(config=cfg, admin_token=TOKEN, log_path=tmp_path / "router.log")
        port = r.port

        def load() -> None:
            for _ in range(2000):
                if stop.is_set():
                    return
                body = {"prompt": "q", "preheat_test": {"hang_s": 0.05}}
                try:
                    status, _, _ = post(f"http://127.0.0.1:{port}/v1/completions", body, timeout=5)
                    results.append((time.monotonic(), "ok" if status == 200 else f"http {status}"))
                except OSError:
                    results.append((time.monotonic(), "conn"))
                    time.sleep(0.02)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        r2 = None
        try:
            time.sleep(1.0)
            killed_at = time.monotonic()
            r.proc.kill()
            r.proc.wait(10)
            r.stop()
            time.sleep(0.5)
            r2 = launch_router(
                config=cfg, admin_token=TOKEN, port=port, log_path=tmp_path / "router2.log"
            )
            back_at = time.monotonic()
            time.sleep(1.5)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            if r2 is not None:
                r2.stop()
    kinds = {k for _, k in results}
    assert kinds <= {"ok", "conn"}, kinds
    before = [k for t, k in results if t < killed_at]
    after = [k for t, k in results if t > back_at + 0.2]
    assert before and all(k == "ok" for k in before)
    assert len(after) > 10 and all(k == "ok" for k in after)
    assert any(k == "conn" for _, k in results)  # the outage was seen


def test_a_hot_prefix_storm_keeps_in_flight_under_the_bound(tmp_path: Path) -> None:
    """One prefix at 50x the rate of each of ten others, 12 clients over 3 engines with
    concurrency_threshold 4: the router's in-flight gauge never shows an instance above 4,
    and the hot prefix is spread over more than one instance."""
    from preheat.testing.engines import simulated_engines

    hot = "The hot shared document. " * 120
    cold = [f"Cold document number {i}. " * 120 for i in range(10)]
    rng = __import__("random").Random(7)
    prompts = [
        (True, hot) if rng.random() < 50 / 60 else (False, rng.choice(cold)) for _ in range(240)
    ]
    peaks: dict[str, float] = {}
    stop = threading.Event()

    def sample(r: RouterProcess) -> None:
        while not stop.is_set():
            for k, v in in_flight(r).items():
                peaks[k] = max(peaks.get(k, 0.0), v)
            time.sleep(0.01)

    with (
        simulated_engines(3, profile="tiny", time_scale=5.0) as engines,
        router_for(
            tmp_path,
            [e.url for e in engines],
            variant={"strategy": "prefix_aware", "concurrency_threshold": 4, "prefix_length": 2048},
        ) as r,
    ):
        it = iter(enumerate(prompts))
        lock = threading.Lock()
        hot_on: set[str] = set()
        statuses: list[int] = []

        def client() -> None:
            while True:
                with lock:
                    nxt = next(it, None)
                if nxt is None:
                    return
                i, (is_hot, text) = nxt
                status, headers, _ = post(
                    r.url + "/v1/completions", {"prompt": text + f" q{i}", "max_tokens": 20}
                )
                statuses.append(status)
                if is_hot:
                    hot_on.add(headers["X-Preheat-Instance"])

        sampler = threading.Thread(target=sample, args=(r,))
        sampler.start()
        clients = [threading.Thread(target=client) for _ in range(12)]
        try:
            for t in clients:
                t.start()
            for t in clients:
                t.join(120)
        finally:
            stop.set()
            sampler.join(10)
    assert statuses.count(200) == len(prompts)
    assert max(peaks.values()) <= 4, peaks
    assert max(peaks.values()) >= 2  # the storm did load the instances
    assert len(hot_on) >= 2, hot_on


def test_many_distinct_prefixes_keep_the_router_memory_bounded(tmp_path: Path) -> None:
    """Distinct prefixes through a prefix_aware router process with index_entries 1,000:
    its RSS after all of them is within 25 MB of its RSS after the first quarter. 12,000
    requests by default (12x the index); PREHEAT_FAULT_PREFIXES=100000 runs the full
    fault-suite size (8.5 min on a loaded 2-core machine; the pure policy test does
    100,000 in seconds)."""
    total = int(os.environ.get("PREHEAT_FAULT_PREFIXES", "12000"))
    first_n = total // 4
    import aiohttp

    async def drive(url: str, start: int, n: int) -> int:
        ok = 0
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            it = iter(range(start, start + n))

            async def worker() -> None:
                nonlocal ok
                for i in it:
                    body = json.dumps({"prompt": f"{i:08d} unique document " * 80, "max_tokens": 1})
                    async with s.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as resp:
                        await resp.read()
                        ok += resp.status == 200

            await asyncio.gather(*(worker() for _ in range(32)))
        return ok

    with (
        start_fast_backend() as b1,
        start_fast_backend() as b2,
        router_for(
            tmp_path,
            [b1.url, b2.url],
            variant={"strategy": "prefix_aware", "index_entries": 1000, "prefix_length": 1024},
        ) as r,
    ):
        url = r.url + "/v1/completions"
        assert asyncio.run(drive(url, 0, first_n)) == first_n
        first = rss_kb(r.pid)
        assert asyncio.run(drive(url, first_n, total - first_n)) == total - first_n
        last = rss_kb(r.pid)
    assert (last - first) / 1024 < 25, f"RSS {first / 1024:.0f} -> {last / 1024:.0f} MB"
