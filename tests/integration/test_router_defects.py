"""Issue 9 defect 8, router items, each against a real router process: a slow client
does not make the router buffer a stream, a full disk under the decision log fails no
request, and ``PUT /admin/config`` applies timeouts live and refuses restart-only fields."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest

from preheat.testing.routers import start_fast_backend

from .test_router_faults import (
    RawEngine,
    chunk,
    get_text,
    metric,
    open_stream,
    post,
    router_for,
    rss_kb,
    self_signed,
    sse_head,
)


@pytest.mark.parametrize(
    ("chunked", "tls"),
    [(True, False), (False, False), (True, True)],
    ids=["chunked", "until-close", "https-aiohttp"],
)
def test_a_slow_client_does_not_make_the_router_buffer_the_stream(
    tmp_path: Path, chunked: bool, tls: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine streams 150 MB as fast as it can to a client that stops reading: the
    router pauses reading the engine (the lean client for http, aiohttp's for https), so
    its RSS grows by far less than the stream."""
    ctx = None
    if tls:
        ctx, cert = self_signed(tmp_path)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the router process trusts it
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

    with RawEngine(flood, ssl=ctx) as engine, router_for(tmp_path, [engine.url]) as r:
        status, _, _ = post(r.url + "/v1/completions", {"prompt": "warm"}, timeout=5)
        assert status == 200
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
