"""The router proxy against real fast backends on 127.0.0.1 (all in one event loop)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from preheat.router.config import parse_config
from preheat.router.server import Router, build_app
from preheat.telemetry.routing import DecisionLog, read_decisions
from preheat.testing.routers import fast_backend_app

SALT = b"0123456789abcdef-test-salt"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def backends() -> AsyncIterator[list[TestServer]]:
    servers = []
    for i in range(3):
        s = TestServer(fast_backend_app(f"b{i}"), host="127.0.0.1")
        await s.start_server()
        servers.append(s)
    yield servers
    for s in servers:
        await s.close()


def _url(s: TestServer) -> str:
    return str(s.make_url("")).rstrip("/")


class RouterUnderTest:
    def __init__(self, router: Router, server: TestServer, session: aiohttp.ClientSession):
        self.router = router
        self.server = server
        self.session = session
        self.url = _url(server)

    async def post(self, path: str, body: Any, **kw: Any) -> aiohttp.ClientResponse:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
        return await self.session.post(self.url + path, data=data, headers=headers, **kw)

    async def admin(
        self, method: str, path: str, body: Any = None, headers: Any = AUTH
    ) -> tuple[int, Any]:
        async with self.session.request(method, self.url + path, json=body, headers=headers) as r:
            return r.status, await r.json()


@pytest.fixture
async def make_router(tmp_path: Path) -> AsyncIterator[Any]:
    made: list[RouterUnderTest] = []

    async def make(instances: list[str], **variant: Any) -> RouterUnderTest:
        top = {
            k: variant.pop(k)
            for k in list(variant)
            if k in ("upstream_timeout_s", "health", "max_body_bytes")
        }
        cfg = parse_config(
            {"variants": [{"name": "default", "instances": instances, **variant}], **top}
        )
        log = DecisionLog(tmp_path / "decisions.jsonl", 1.0, rng=random.Random(0))
        router = Router(cfg, salt=SALT, admin_token=TOKEN, decision_log=log, rng=random.Random(0))
        server = TestServer(build_app(router), host="127.0.0.1")
        await server.start_server()
        rut = RouterUnderTest(router, server, aiohttp.ClientSession())
        made.append(rut)
        return rut

    yield make
    for r in made:
        await r.session.close()
        await r.server.close()


async def test_completions_and_chat_are_forwarded_unchanged(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """Bodies reach the instance byte for byte; answers come back with the instance header."""
    r = await make_router([_url(b) for b in backends], strategy="prefix_aware")
    raw = b'{"model": "m",  "prompt": "hello world", "max_tokens": 2}'
    async with await r.post("/v1/completions", raw) as resp:
        assert resp.status == 200
        doc = await resp.json()
        assert doc["body_sha256"] == hashlib.sha256(raw).hexdigest()
        assert resp.headers["X-Preheat-Instance"] in {_url(b) for b in backends}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with await r.post("/v1/chat/completions", chat) as resp:
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "ok"
    async with r.session.get(r.url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "fake"


async def test_streaming_passes_chunks_through_as_they_arrive(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """The first SSE chunk reaches the client before the instance has finished."""
    r = await make_router([_url(backends[0])])
    body = {"prompt": "x", "stream": True, "max_tokens": 4, "preheat_test": {"chunk_gap_s": 0.3}}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with await r.post("/v1/completions", body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await resp.content.readline()
        t_first = loop.time() - t0
        rest = await resp.read()
    assert first.startswith(b"data: ")
    assert t_first < 0.25
    assert rest.rstrip().endswith(b"data: [DONE]")


async def test_bad_input_gets_openai_errors(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """Malformed JSON -> 400, a body over the limit -> 413, both in OpenAI error format."""
    r = await make_router([_url(backends[0])], max_body_bytes=4096)
    async with await r.post("/v1/completions", b"{not json") as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["type"] == "invalid_request_error" and "not valid JSON" in err["message"]
    async with await r.post("/v1/completions", {"prompt": "x" * 10_000}) as resp:
        assert resp.status == 413
        assert "4096 bytes" in (await resp.json())["error"]["message"]
    async with await r.post("/v1/completions", [1, 2]) as resp:
        assert resp.status == 400


async def test_no_instance_gives_503_until_one_is_added(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """A variant with no instance answers 503 + Retry-After; adding one fixes it live."""
    r = await make_router([], strategy="prefix_aware")
    async with await r.post("/v1/completions", {"prompt": "x"}) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    status, doc = await r.admin(
        "POST", "/admin/instances/add", {"variant": "default", "url": _url(backends[1])}
    )
    assert status == 200
    assert doc["variants"][0]["instances"] == [
        {"url": _url(backends[1]), "state": "healthy", "in_flight": 0}
    ]
    async with await r.post("/v1/completions", {"prompt": "x"}) as resp:
        assert resp.status == 200 and resp.headers["X-Preheat-Instance"] == _url(backends[1])


async def test_an_instance_dying_mid_stream(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """The client's stream ends with an error event; the instance is marked down."""
    urls = [_url(b) for b in backends[:2]]
    r = await make_router(urls, strategy="prefix_aware")
    body = {"prompt": "p" * 2000, "stream": True, "max_tokens": 5, "preheat_test": {"die_after": 2}}
    async with await r.post("/v1/completions", body) as resp:
        victim = resp.headers["X-Preheat-Instance"]
        text = (await resp.read()).decode()
    assert text.count("data: {") == 3  # two chunks, then the error event
    assert "event: error" in text and "failed mid-stream" in text
    _status, doc = await r.admin("GET", "/admin/config")
    states = {i["url"]: i["state"] for i in doc["variants"][0]["instances"]}
    assert states[victim] == "unhealthy"
    for _ in range(3):
        async with await r.post("/v1/completions", {"prompt": "p" * 2000}) as resp:
            assert resp.status == 200 and resp.headers["X-Preheat-Instance"] != victim


async def test_a_hanging_instance_times_out_with_504(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """No byte within upstream_timeout_s -> 504 in OpenAI format."""
    r = await make_router([_url(backends[0])], upstream_timeout_s=0.3)
    async with await r.post(
        "/v1/completions", {"prompt": "x", "preheat_test": {"hang_s": 2}}
    ) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["type"] == "upstream_timeout"


async def test_a_refused_connection_is_retried_elsewhere(
    backends, make_router, free_port: int
) -> None:  # type: ignore[no-untyped-def]
    """An instance that is not listening is marked unhealthy; the request still succeeds."""
    dead = f"http://127.0.0.1:{free_port}"
    r = await make_router([dead, _url(backends[0])], strategy="least_outstanding")
    for _ in range(4):
        async with await r.post("/v1/completions", {"prompt": "x"}) as resp:
            assert resp.status == 200 and resp.headers["X-Preheat-Instance"] == _url(backends[0])
    assert r.router.find(dead).state == "unhealthy"  # type: ignore[union-attr]


async def test_health_checks_remove_and_return_instances(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """A failing /health takes the instance out; a passing one puts it back."""
    urls = [_url(b) for b in backends[:2]]
    r = await make_router(urls, health={"interval_s": 0.05, "failures": 2, "timeout_s": 1})
    async with r.session.post(urls[0] + "/control", json={"healthy": False}):
        pass
    for _ in range(100):
        if r.router.find(urls[0]).state == "unhealthy":  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.05)
    assert r.router.find(urls[0]).state == "unhealthy"  # type: ignore[union-attr]
    for _ in range(6):
        async with await r.post("/v1/completions", {"prompt": "x"}) as resp:
            assert resp.headers["X-Preheat-Instance"] == urls[1]
    async with r.session.post(urls[0] + "/control", json={"healthy": True}):
        pass
    for _ in range(100):
        if r.router.find(urls[0]).state == "healthy":  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.05)
    assert r.router.find(urls[0]).state == "healthy"  # type: ignore[union-attr]


async def test_admin_needs_the_token(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """No token or a wrong token -> 401 on every admin route."""
    r = await make_router([_url(backends[0])])
    for method, path in (
        ("GET", "/admin/config"),
        ("PUT", "/admin/config"),
        ("POST", "/admin/instances/add"),
        ("PATCH", "/admin/variants/default"),
    ):
        status, _ = await r.admin(method, path, {}, headers={})
        assert status == 401
        status, _ = await r.admin(method, path, {}, headers={"Authorization": "Bearer nope"})
        assert status == 401


async def test_admin_reconfigures_without_restart(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """PUT replaces the config (invalid -> 400, old kept); PATCH changes a strategy; drain and remove stop traffic."""
    urls = [_url(b) for b in backends]
    r = await make_router(urls[:2])
    status, doc = await r.admin("GET", "/admin/config")
    assert status == 200 and doc["variants"][0]["strategy"] == "random"
    bad = json.loads(json.dumps(doc))
    bad["variants"][0]["prefix_length"] = 100
    status, err = await r.admin("PUT", "/admin/config", bad)
    assert status == 400 and "prefix_length 100" in err["error"]["message"]
    status, now = await r.admin("GET", "/admin/config")
    assert now == doc
    good = json.loads(json.dumps(doc))
    good["variants"][0]["instances"].append(urls[2])
    good["variants"][0]["strategy"] = "least_outstanding"
    status, now = await r.admin("PUT", "/admin/config", good)
    assert status == 200 and len(now["variants"][0]["instances"]) == 3
    status, now = await r.admin(
        "PATCH", "/admin/variants/default", {"strategy": "prefix_aware", "concurrency_threshold": 8}
    )
    assert status == 200 and now["variants"][0]["strategy"] == "prefix_aware"
    assert now["variants"][0]["concurrency_threshold"] == 8
    status, err = await r.admin("PATCH", "/admin/variants/default", {"strategy": "fastest"})
    assert status == 400 and "fastest" in err["error"]["message"]
    status, _ = await r.admin("PATCH", "/admin/variants/nope", {"weight": 2})
    assert status == 404
    status, now = await r.admin(
        "POST", "/admin/instances/drain", {"variant": "default", "url": urls[0]}
    )
    assert {i["url"]: i["state"] for i in now["variants"][0]["instances"]}[urls[0]] == "draining"
    status, now = await r.admin(
        "POST", "/admin/instances/remove", {"variant": "default", "url": urls[1]}
    )
    assert [i["url"] for i in now["variants"][0]["instances"]] == [urls[0], urls[2]]
    for i in range(5):
        async with await r.post("/v1/completions", {"prompt": f"{i}" * 3000}) as resp:
            assert resp.headers["X-Preheat-Instance"] == urls[2]
    status, err = await r.admin(
        "POST", "/admin/instances/add", {"variant": "default", "url": "ftp://x"}
    )
    assert status == 400 and "http(s)://host:port" in err["error"]["message"]


async def test_drain_lets_in_flight_requests_finish(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """A request in flight on a drained instance completes; in_flight returns to 0."""
    r = await make_router([_url(backends[0]), _url(backends[1])], strategy="least_outstanding")
    slow = asyncio.create_task(
        r.post("/v1/completions", {"prompt": "x", "preheat_test": {"hang_s": 0.5}})
    )
    await asyncio.sleep(0.15)
    busy = next(u for u in r.router.variants["default"].upstreams.values() if u.in_flight == 1)
    _status, doc = await r.admin(
        "POST", "/admin/instances/drain", {"variant": "default", "url": busy.id}
    )
    assert {i["url"]: i["in_flight"] for i in doc["variants"][0]["instances"]}[busy.id] == 1
    resp = await slow
    assert resp.status == 200
    resp.release()
    assert busy.in_flight == 0 and busy.state == "draining"


async def test_decision_log_and_metrics(backends, make_router, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Each decision is a JSONL line with the report's keys and no prompt text; metrics count them."""
    r = await make_router([_url(b) for b in backends], strategy="prefix_aware")
    secret = "TOPSECRETPROMPT " * 200
    for stream in (False, True):
        async with await r.post("/v1/completions", {"prompt": secret, "stream": stream}) as resp:
            await resp.read()
    text = (tmp_path / "decisions.jsonl").read_text()
    assert "TOPSECRET" not in text
    rows = read_decisions(tmp_path / "decisions.jsonl")
    assert len(rows) == 2
    assert {row.actual_cached_tokens for row in rows} == {7}
    assert (
        rows[1].outcome == "affinity" and rows[1].matched_blocks == 2 and rows[1].prefix_blocks == 2
    )
    assert rows[0].outcome == "fallback" and rows[0].matched_blocks == 0
    keys = set(json.loads(text.splitlines()[0]))
    assert keys == {
        "ts",
        "request_id",
        "variant",
        "strategy",
        "instance",
        "rank",
        "outcome",
        "matched_blocks",
        "prefix_blocks",
        "predicted_cached_tokens",
        "actual_cached_tokens",
        "prompt_tokens",
        "decision_us",
    }
    async with r.session.get(r.url + "/metrics") as resp:
        m = await resp.text()
    assert (
        'preheat_router_decisions_total{outcome="affinity",strategy="prefix_aware",variant="default"} 1.0'
        in m
    )
    assert 'outcome="fallback",strategy="prefix_aware",variant="default"} 1.0' in m
    assert "preheat_router_decision_seconds_bucket" in m and "preheat_router_in_flight" in m
    assert "TOPSECRET" not in m


async def test_a_stale_keep_alive_connection_is_retried_not_failed(make_router) -> None:  # type: ignore[no-untyped-def]
    """An instance that closes a reused connection without answering (as llama-server
    does with idle ones) costs one retry on a fresh connection, not a failure."""
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if not first:  # a reused connection: hang up without an answer
                    break
                first = False
                # Count the proxied requests only (the router also GETs /metrics and
                # /props to learn the instance's KV capacity).
                served += head.startswith(b"POST")
                body = b'{"choices": [{"text": "ok"}]}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        r = await make_router([url])
        for _ in range(3):
            async with await r.post("/v1/completions", {"prompt": "x"}) as resp:
                assert resp.status == 200
        assert served == 3
        assert r.router.find(url).state == "healthy"  # type: ignore[union-attr]
    finally:
        server.close()
        await server.wait_closed()


async def test_models_without_instances_is_503(make_router) -> None:  # type: ignore[no-untyped-def]
    """/v1/models needs a healthy instance too."""
    r = await make_router([])
    async with r.session.get(r.url + "/v1/models") as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"


async def test_a_client_leaving_mid_stream_frees_the_instance(backends, make_router) -> None:  # type: ignore[no-untyped-def]
    """The router stops relaying, the in-flight count returns to 0, nothing is marked down."""
    r = await make_router([_url(backends[0])])
    body = {"prompt": "x", "stream": True, "max_tokens": 20, "preheat_test": {"chunk_gap_s": 0.1}}
    resp = await r.post("/v1/completions", body)
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()  # hang up mid-stream
    up = r.router.find(_url(backends[0]))
    assert up is not None
    for _ in range(60):
        if up.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert up.in_flight == 0 and up.state == "healthy"
    async with await r.post("/v1/completions", {"prompt": "x"}) as again:
        assert again.status == 200
