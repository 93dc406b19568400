"""Our client, metrics reader and start probe against the real llama.cpp ``llama-server``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.engine.client import EngineClient
from preheat.testing.engines import (
    EngineProcess,
    llama_server,
    llama_server_missing_reason,
    write_tiny_llama_gguf,
)

_MISSING = llama_server_missing_reason()
pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]

SHARED = (
    "The model cache keeps weights on each node's local disk before a replica needs them. "
    "Prefix-aware routing sends requests that share a prompt prefix to the same instance. "
) * 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[EngineProcess]:
    with llama_server(model, slots=2, alias="preheat/tiny-llama") as srv:
        yield srv


async def test_start_probe_observes_stages(model: Path) -> None:
    """Without /startup the probe observes the first answer and the first healthy /health."""
    with llama_server(model, slots=1, wait=False) as srv:
        async with EngineClient(srv.url) as c:
            st = await c.probe_start(spawned_at=srv.spawned_at, timeout_s=60)
    assert st.source == "observed"
    assert st.runtime_started == srv.spawned_at
    assert st.healthy is not None and st.weights_loaded == st.healthy
    assert st.healthy >= srv.spawned_at


async def test_prefix_reuse_reported_in_usage_and_metrics(server: EngineProcess) -> None:
    """A second prompt with the same prefix reports cached tokens, and the metrics agree."""
    async with EngineClient(server.url) as c:
        before = await c.metrics()
        first = await c.completion(SHARED + "First question?", max_tokens=4)
        second = await c.completion(SHARED + "Second question?", max_tokens=4)
        after = await c.metrics()
    assert before.flavour == after.flavour == "llamacpp"
    assert first.completion_tokens == 4 and second.completion_tokens == 4
    assert second.cached_tokens is not None and second.cached_tokens > first.prompt_tokens // 2
    assert after.prefix_cache_hits - before.prefix_cache_hits == (
        (first.cached_tokens or 0) + second.cached_tokens
    )
    assert after.prefix_cache_queries - before.prefix_cache_queries == (
        first.prompt_tokens + second.prompt_tokens
    )
    assert after.generation_tokens - before.generation_tokens == 8


async def test_chat_stream_and_models(server: EngineProcess) -> None:
    """Streaming chat and /v1/models work through the same client code."""
    async with EngineClient(server.url) as c:
        assert "preheat/tiny-llama" in await c.models()
        r = await c.chat([{"role": "user", "content": "hello there"}], max_tokens=5, stream=True)
        assert r.completion_tokens == 5
        assert r.prompt_tokens > 0
        assert r.ttft_s <= r.e2e_s
        assert await c.health()


@pytest.mark.parametrize(("slots", "hits_on_return"), [(1, False), (2, True)])
async def test_slots_bound_the_prompt_cache(model: Path, slots: int, hits_on_return: bool) -> None:
    """With -np N --cache-ram 0 an engine keeps exactly N prompts: A,B,A hits only if N >= 2."""
    a = "The model cache keeps weights on each node's local disk. " * 3 + "ok?"
    b = "Prefix-aware routing sends requests to the same instance. " * 3 + "ok?"
    with llama_server(model, slots=slots) as srv:
        async with EngineClient(srv.url) as c:
            results = [await c.completion(p, max_tokens=2) for p in (a, b, a)]
    third = results[2]
    assert results[0].cached_tokens == 0 and results[1].cached_tokens == 0
    assert third.cached_tokens is not None
    if hits_on_return:
        assert third.cached_tokens == third.prompt_tokens - 1  # all but the last token
    else:
        assert third.cached_tokens == 0
