"""The simulated engine as a real process on 127.0.0.1, driven through its HTTP API."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.engine.client import EngineClient, parse_metrics
from preheat.engine.config import EngineConfig
from preheat.engine.server import EngineServer
from preheat.testing.engines import EngineProcess, simulated_engines
from preheat.timing import PROFILES

DOC = "Prefix caching reuses the keys and values of a shared prompt start. " * 60


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    """One tiny engine at 1/100 of real time, shared by this module's tests."""
    with simulated_engines(1, profile="tiny", time_scale=0.01) as engines:
        yield engines[0]


async def test_completion_usage_and_prefix_hits(engine: EngineProcess) -> None:
    """A repeated long prompt reports cached tokens, and the metrics count them."""
    async with EngineClient(engine.url) as c:
        before = await c.metrics()
        cold = await c.completion(DOC + "Question one?", max_tokens=7)
        warm = await c.completion(DOC + "Question two?", max_tokens=3)
        after = await c.metrics()
    assert cold.completion_tokens == 7 and warm.completion_tokens == 3
    assert cold.text.count(" ") >= 6  # filler words, one per token
    assert cold.cached_tokens == 0
    assert warm.cached_tokens is not None and warm.cached_tokens >= warm.prompt_tokens - 16 - 8
    assert after.flavour == "vllm"
    assert after.prefix_cache_queries - before.prefix_cache_queries == (
        cold.prompt_tokens + warm.prompt_tokens
    )
    assert after.prefix_cache_hits - before.prefix_cache_hits == warm.cached_tokens
    assert after.generation_tokens - before.generation_tokens == 10
    assert after.ttft_count - before.ttft_count == 2


async def test_chat_streaming_sse(engine: EngineProcess) -> None:
    """Streaming chat yields one chunk per token, a usage chunk and [DONE]."""
    async with EngineClient(engine.url, model="preheat/tiny") as c:
        r = await c.chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            max_tokens=5,
            stream=True,
        )
    assert r.completion_tokens == 5
    assert len(r.itl_s) == 4
    assert r.finish_reason == "length"
    assert r.ttft_s <= r.e2e_s
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
        async with s.post(engine.url + "/v1/chat/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
    assert text.rstrip().endswith("data: [DONE]")
    assert text.count('"delta"') == 3  # role chunk + 2 content chunks


async def test_models_health_metrics_names(engine: EngineProcess) -> None:
    """/v1/models lists the profile's model; /metrics carries every vLLM name the router reads."""
    async with EngineClient(engine.url) as c:
        assert await c.models() == ["preheat/tiny"]
        assert await c.health()
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "many"}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
        ("/v1/completions", b'{"prompt": "hi", "model": "gpt-5"}', 404, "model"),
        ("/v1/chat/completions", b'{"max_tokens": 3}', 400, "messages"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "bot", "content": "x"}]}',
            400,
            "messages[0].role",
        ),
    ],
)
async def test_bad_input_gets_openai_errors(
    engine: EngineProcess, path: str, body: bytes, status: int, param: str | None
) -> None:
    """Malformed bodies get OpenAI-style errors naming the field, never a crash."""
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + path, data=body) as resp:
            data = await resp.json()
        assert resp.status == status
        assert data["error"]["param"] == param
        assert data["error"]["message"]
        async with s.get(engine.url + "/health") as h:
            assert h.status == 200


async def test_prompt_too_long_and_body_too_large(engine: EngineProcess) -> None:
    """A prompt beyond the context is 400 with the limit; a body over 8 MiB is 413."""
    async with aiohttp.ClientSession() as s:
        long_prompt = "word " * (PROFILES["tiny"].max_model_len + 10)
        async with s.post(engine.url + "/v1/completions", json={"prompt": long_prompt}) as r:
            data = await r.json()
            assert r.status == 400
            assert "maximum context length is 32768" in data["error"]["message"]
        big = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
        async with s.post(engine.url + "/v1/completions", data=io.BytesIO(big)) as r:
            data = await r.json()
            assert r.status == 413
            assert "limit" in data["error"]["message"]


async def test_disconnect_mid_stream_frees_blocks(engine: EngineProcess) -> None:
    """A client that goes away mid-stream has its sequence aborted and KV blocks freed."""
    async with EngineClient(engine.url) as c:
        base = await c.metrics()
        assert base.requests_running == 0
        async with aiohttp.ClientSession() as s:
            body = {"prompt": DOC, "max_tokens": 30_000, "stream": True}
            resp = await s.post(engine.url + "/v1/completions", json=body)
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
            during = await c.metrics()
            assert during.requests_running == 1
            assert during.kv_cache_usage is not None and during.kv_cache_usage > 0
            resp.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = await c.metrics()
            if m.requests_running == 0 and m.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.05)
        assert (m.requests_running, m.kv_cache_usage) == (0, 0)
        assert m.samples.get("vllm:generation_tokens_total", 0) < base.generation_tokens + 30_000


async def test_disconnect_while_waiting_for_plain_response(engine: EngineProcess) -> None:
    """A non-streaming client that gives up also has its sequence aborted."""
    async with EngineClient(engine.url) as c:
        task = asyncio.create_task(c.completion(DOC, max_tokens=30_000))
        deadline = time.monotonic() + 10
        while (await c.metrics()).requests_running == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await c.close()  # drop the pooled connection the cancelled request used
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = await c.metrics()
            if m.requests_running == 0 and m.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.05)
        assert (m.requests_running, m.kv_cache_usage) == (0, 0)


async def test_startup_stages_with_snapshot(tmp_path: Path) -> None:
    """With --snapshot every weight byte is read before healthy; /startup has ordered epoch stages."""
    snap = tmp_path / "snap"
    (snap / "sub").mkdir(parents=True)
    sizes = {"model-00001.safetensors": 3_000_000, "sub/model-00002.safetensors": 1_234_567}
    for name, size in sizes.items():
        (snap / name).write_bytes(b"\x01" * size)
    t0 = time.time()
    with simulated_engines(
        1, snapshot=snap, model_name="acme/chat", extra=["--warmup-seconds", "20"]
    ) as (eng,):
        async with EngineClient(eng.url) as c:
            st = await c.probe_start(spawned_at=eng.spawned_at)
            assert await c.models() == ["acme/chat"]
        log = eng.log()
    assert st.source == "startup"
    assert st.weights_bytes == sum(sizes.values())
    assert st.extra["weights_files"] == 2
    assert st.runtime_started is not None and st.weights_loaded is not None
    assert st.healthy is not None
    assert t0 <= st.runtime_started <= st.weights_loaded <= st.healthy <= time.time()
    # 20 s of warm-up at --time-scale 0.01 (uvloop timers have 1 ms granularity)
    assert st.healthy - st.weights_loaded >= 0.195
    assert "start_stage" in log and "weights_loaded" in log


async def test_health_is_503_until_weights_are_read(free_port: int) -> None:
    """Before the weights are read /health and requests are 503; after, 200."""
    server = EngineServer(EngineConfig(profile=PROFILES["tiny"], port=free_port, time_scale=0))
    await server.start()
    try:
        async with EngineClient(f"http://127.0.0.1:{free_port}") as c:
            assert not await c.health()
            async with c.session.post(c.base_url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503
            st = await c.session.get(c.base_url + "/startup")
            assert "weights_loaded" not in (await st.json())["stages"]
            await server.load_weights()
            assert await c.health()
            r2 = await c.completion("hello", max_tokens=2)
            assert r2.completion_tokens == 2
    finally:
        await server.close()


async def test_metrics_reader_parses_engine_text() -> None:
    """parse_metrics maps vLLM text (with labels and histograms) onto EngineMetrics."""
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{model_name="m"} 100.0\n'
        'vllm:prefix_cache_hits_total{model_name="m"} 64.0\n'
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0\n'
    )
    m = parse_metrics(text)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.requests_running) == (100, 64, 3)
    assert m.kv_cache_usage == 0.25 and m.hit_rate == 0.64


def test_cli_help_and_profiles() -> None:
    """`preheat engine serve --help` explains the options; `profiles` lists the four profiles."""
    r = CliRunner().invoke(main, ["engine", "serve", "--help"])
    assert r.exit_code == 0
    assert "--time-scale" in r.output and "--snapshot" in r.output
    r = CliRunner().invoke(main, ["engine", "profiles"])
    assert r.exit_code == 0
    for name in PROFILES:
        assert name in r.output
    bad = CliRunner().invoke(main, ["engine", "serve", "--profile", "gpt-9"])
    assert bad.exit_code == 2 and "gpt-9" in bad.output
