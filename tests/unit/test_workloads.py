"""Seeded workloads: repeatable, skewed where they should be, with the right structure."""

from __future__ import annotations

from collections import Counter

import pytest

from preheat.bench.routing import oracle_hit_rate
from preheat.bench.workloads import (
    CHAT,
    COMPLETIONS,
    WORKLOADS,
    chat,
    rag,
    templated,
    unique,
    zipf_weights,
)
from preheat.engine.core.tokenizer import Tokenizer
from preheat.errors import ConfigError


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_stream(name: str) -> None:
    """A workload is a pure function of its arguments."""
    a = WORKLOADS[name](40, seed=5)
    b = WORKLOADS[name](40, seed=5)
    c = WORKLOADS[name](40, seed=6)
    assert a == b
    assert a != c
    assert len({i.request_id for i in a}) == 40


def test_rag_popularity_is_zipf_skewed() -> None:
    """The most popular document gets far more than its uniform share."""
    items = rag(2000, documents=50, zipf_s=1.1, doc_chars=500, seed=1)
    counts = Counter(i.group for i in items)
    top = counts.most_common(1)[0][1] / len(items)
    assert top > 0.15 > 1 / 50
    assert zipf_weights(50, 1.1)[0] == pytest.approx(top, abs=0.04)
    assert all(i.path == CHAT for i in items)


def test_chat_turns_extend_their_conversation_and_wait_for_it() -> None:
    """Turn k+1 starts with turn k's messages and names turn k in ``after``."""
    items = chat(200, active=8, turns=4, seed=2)
    by_id = {i.request_id: i for i in items}
    followers = [i for i in items if i.after is not None]
    assert len(followers) > 100
    for item in followers:
        prev = by_id[item.after]  # type: ignore[index]
        assert prev.group == item.group
        n = len(prev.body["messages"])
        assert item.body["messages"][:n] == prev.body["messages"]
        assert len(item.body["messages"]) == n + 2
    assert max(len(i.body["messages"]) for i in items) == 1 + 2 * 4 - 1


def test_templated_and_unique_shapes() -> None:
    """Templates repeat a long prefix; unique prompts share nothing."""
    t = templated(100, templates=4, seed=3)
    assert len({i.group for i in t}) <= 4 and all(i.path == COMPLETIONS for i in t)
    u = unique(50, chars=800, seed=3)
    assert len({i.body["prompt"][:20] for i in u}) == 50


def test_oracle_bounds_the_sharing() -> None:
    """Unique prompts cannot hit; repeated templates hit almost everything."""
    assert oracle_hit_rate(unique(30, chars=800)) < 0.02
    assert oracle_hit_rate(templated(60, templates=2, template_chars=3000)) > 0.8


def test_bad_sizes_are_refused() -> None:
    """Sizes below 1 name the argument."""
    with pytest.raises(ConfigError, match="documents 0"):
        rag(10, documents=0)


def test_summarize_uses_engine_counter_deltas_and_interpolated_percentiles() -> None:
    """Hit rate and shares come from counter deltas; TTFT percentiles match the report's."""
    from preheat.bench.routing import Outcome, summarize
    from preheat.engine.client import EngineMetrics
    from preheat.telemetry.stats import percentile

    def m(queries: float, hits: float, done: float) -> EngineMetrics:
        return EngineMetrics(
            flavour="vllm",
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            requests_running=0,
            requests_waiting=0,
            kv_cache_usage=None,
            prompt_tokens=queries,
            generation_tokens=0,
            samples={'vllm:request_success_total{finished_reason="stop"}': done},
        )

    before = {"a": m(100, 10, 5), "b": m(50, 0, 1)}
    after = {"a": m(400, 210, 8), "b": m(150, 50, 2)}
    ttfts = [0.01, 0.02, 0.03, 0.10]
    outcomes = [Outcome(str(i), "g", 200, t, t, "a", None, None) for i, t in enumerate(ttfts)] + [
        Outcome("x", "g", 503, None, 0.0, None, None, None, "busy")
    ]
    s = summarize(outcomes, 2.0, before, after)
    assert s["hit_rate"] == (200 + 50) / (300 + 100)
    assert s["shares"] == {"a": 0.75, "b": 0.25}
    assert s["max_share_ratio"] == 1.5
    assert s["errors"] == 1 and s["throughput_rps"] == 2.0
    assert s["ttft_p50_s"] == percentile(ttfts, 50) == 0.025
    assert s["ttft_p90_s"] == percentile(ttfts, 90)


def test_mixed_traffic_interleaves_every_workload_in_its_own_order() -> None:
    """Mixed traffic holds all four kinds near their shares; chat turns follow their turn."""
    from preheat.bench.workloads import MIX, mixed

    items = mixed(1000, seed=4)
    kinds = Counter(i.request_id.split("-")[0] for i in items)
    assert set(kinds) == {"rag", "chat", "tpl", "uniq"}
    for name, prefix in (
        ("rag", "rag"),
        ("chat", "chat"),
        ("templated", "tpl"),
        ("unique", "uniq"),
    ):
        assert kinds[prefix] / 1000 == pytest.approx(MIX[name], abs=0.05)
    position = {i.request_id: n for n, i in enumerate(items)}
    followers = [i for i in items if i.after is not None]
    assert followers and all(position[i.after] < position[i.request_id] for i in followers)  # type: ignore[index]
    with pytest.raises(ConfigError, match="unknown: \\['video'\\]"):
        mixed(10, weights={"video": 1.0})


def test_peer_workload_shapes_have_their_published_token_counts() -> None:
    """sglang-gsp: groups share a system prompt of 2,138 tokens, questions are 535; all
    groups (128 by default) appear in a shuffled order. llmd-b2b: a customer's users share its 6,000-token
    context, queries are ~1,200 tokens (simulated tokenizer)."""
    tok = Tokenizer()
    gsp = WORKLOADS["sglang-gsp"](32, groups=8, seed=1)
    assert len({w.group for w in gsp}) == 8
    assert [w.group for w in gsp[:8]] != [f"group{g}" for g in range(8)]
    first = gsp[0].body["messages"]
    assert len(tok.encode(first[0]["content"])) == pytest.approx(2138 + 3, abs=3)
    assert len(tok.encode(first[1]["content"])) == 535
    same = [w for w in gsp if w.group == gsp[0].group]
    assert len({w.body["messages"][0]["content"] for w in same}) == 1
    b2b = WORKLOADS["llmd-b2b"](12, customers=4, seed=2)
    ctx = {w.group.split("/")[0]: w.body["messages"][0]["content"] for w in b2b}
    assert len(ctx) == 4
    assert all(len(tok.encode(c)) == pytest.approx(6000 + 3, abs=3) for c in ctx.values())
    assert len(tok.encode(b2b[0].body["messages"][1]["content"])) == pytest.approx(1200, abs=4)
