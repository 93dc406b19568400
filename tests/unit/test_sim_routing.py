"""The fleet simulator's routing half: event core, engines, prompts, conservation, determinism."""

from __future__ import annotations

import random

import pytest
from click.testing import CliRunner

from preheat.bench.routing import prompt_tokens
from preheat.bench.workloads import WORKLOADS, WorkItem, aws_8k
from preheat.cli import main
from preheat.engine import openai_api as engine_server
from preheat.engine.core.scheduler import Scheduler
from preheat.engine.core.tokenizer import Tokenizer
from preheat.errors import ConfigError
from preheat.kvcache import block_hashes
from preheat.router.policies import PolicyParams
from preheat.sim import prompts
from preheat.sim.prompts import PromptBuilder
from preheat.sim.routing import RoutingConfig, SimItem, simulate_routing
from preheat.timing import get_profile

TINY = get_profile("tiny")


def _items(name: str, n: int, seed: int = 1, **kw: object) -> list[SimItem]:
    return [
        SimItem(w.request_id, w.path, w.body, w.after) for w in WORKLOADS[name](n, seed=seed, **kw)
    ]


def _run(items: list[SimItem], seed: int = 0, **kw: object) -> dict[str, object]:
    cfg = RoutingConfig(**({"instances": 4, "profile": TINY, "policy": "prefix_aware"} | kw))  # type: ignore[arg-type]
    res = simulate_routing(
        items, cfg, policy_rng=random.Random(seed), arrival_rng=random.Random(seed + 1)
    )
    return res.summary()


def test_prompts_match_the_engine_tokens_and_hashes() -> None:
    """Memoised tokens and block hashes equal a from-scratch encode of every workload."""
    b = PromptBuilder(memo_tokens=20_000)  # small memo: eviction is exercised too
    for name in sorted(WORKLOADS):
        for w in WORKLOADS[name](25, seed=3):
            p = b.build(w.path, w.body)
            ref = prompt_tokens(w)
            assert list(p.tokens) == ref, (name, w.request_id)
            assert list(p.hashes) == block_hashes(ref), (name, w.request_id)


def test_prompt_defaults_are_the_engines() -> None:
    """Default max_tokens are the live engine's for chat and completions."""
    assert prompts.DEFAULT_CHAT_MAX_TOKENS == engine_server.DEFAULT_CHAT_MAX_TOKENS
    assert prompts.DEFAULT_COMPLETION_MAX_TOKENS == engine_server.DEFAULT_COMPLETION_MAX_TOKENS
    b = PromptBuilder()
    assert b.build(None, {"messages": [{"role": "user", "content": "hi"}]}).max_tokens == 128
    assert b.build(None, {"prompt": [5, 6, 7]}).tokens == (5, 6, 7)
    with pytest.raises(ConfigError, match="max_tokens"):
        b.build(None, {"prompt": "x", "max_tokens": 0})


def test_aws_8k_has_an_exact_8000_token_prefix() -> None:
    """aws-8k's shared system prompt is 8,000 tokens under the engine's tokenizer."""
    tok = Tokenizer()
    items = aws_8k(4, families=2, seed=2)
    assert {tok.count(i.body["messages"][0]["content"]) for i in items} == {8000}
    assert {tok.count(i.body["messages"][1]["content"]) for i in items} == {100}


def test_same_seed_same_run_other_seed_differs() -> None:
    """A run is a pure function of its inputs and seeds."""
    items = _items("rag", 150, documents=10, doc_chars=2000)
    a = _run(items, policy="random", concurrency=6)
    assert a == _run(items, policy="random", concurrency=6)
    assert a != _run(items, seed=9, policy="random", concurrency=6)


@pytest.mark.parametrize(
    ("name", "kw"),
    [("chat", {"concurrency": 5}), ("chat", {"rate": 300.0}), ("templated", {"concurrency": 12})],
)
def test_every_request_is_accounted_for(name: str, kw: dict[str, object]) -> None:
    """Each request is decided once and finishes once; shares sum to one."""
    items = _items(name, 120)
    s = _run(items, **kw)
    assert s["requests"] == 120 and s["errors"] == 0
    assert sum(s["decisions"].values()) == 120  # type: ignore[attr-defined]
    assert sum(s["shares"].values()) == pytest.approx(1.0)  # type: ignore[attr-defined]
    assert s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_p99_ms"]  # type: ignore[operator]


def test_chat_turns_wait_for_their_previous_turn() -> None:
    """An open-loop turn is sent only after the turn it extends has finished."""
    items = _items("chat", 40, active=1, turns=40)
    chained = _run(items, rate=1000.0, instances=2)
    free = _run([SimItem(i.request_id, i.path, i.body) for i in items], rate=1000.0, instances=2)
    # 40 dependent turns of 32 output tokens each, one decode step per token at least.
    assert chained["virtual_s"] > 40 * 32 * TINY.decode_step_time(1, 100)  # type: ignore[operator]
    assert free["virtual_s"] < chained["virtual_s"] / 5  # type: ignore[operator]


def test_kv_hits_equal_a_lone_scheduler_on_a_fixed_stream() -> None:
    """One instance at concurrency 1 counts exactly the hits its scheduler alone would."""
    items = _items("rag", 30, documents=3, doc_chars=3000)
    s = _run(items, instances=1, concurrency=1, kv_blocks=400)
    sched = Scheduler(TINY, kv_blocks=400)
    now = 0.0
    for k, it in enumerate(items):
        w = WorkItem(it.request_id, it.path or "", dict(it.body), "g")
        sched.add_request(k, prompt_tokens(w), int(it.body["max_tokens"]), now)
        now, _ = sched.run_until_idle(now)
    assert s["kv_hit_rate"] == sched.kv.hits / sched.kv.queries
    assert 0.3 < s["kv_hit_rate"] < 1.0


def test_small_kv_preempts_and_still_finishes() -> None:
    """A KV cache too small for the batch preempts sequences, which then finish."""
    items = _items("unique", 12, chars=3000, max_tokens=400)
    s = _run(items, instances=1, concurrency=6, kv_blocks=120)
    assert s["preemptions"] > 0
    assert s["errors"] == 0 and sum(s["shares"].values()) == 1.0  # type: ignore[attr-defined]


def test_prompt_too_long_is_an_error_not_a_crash() -> None:
    """A prompt beyond the engine's context is routed, refused, and counted as an error."""
    items = _items("unique", 5, chars=500)
    huge = SimItem("huge", "/v1/completions", {"prompt": "word " * 40_000, "max_tokens": 4})
    s = _run([*items, huge], concurrency=2)
    assert s["errors"] == 1
    assert sum(s["decisions"].values()) == 6  # type: ignore[attr-defined]


def test_prefix_aware_beats_random_on_shared_prefixes() -> None:
    """On RAG over a few documents the live prefix policy raises the engines' hit rate."""
    items = _items("rag", 300, documents=12, doc_chars=4000)
    kw: dict[str, object] = {"concurrency": 8, "kv_blocks": 300}  # ~4 documents per engine
    r = _run(items, policy="random", **kw)
    p = _run(items, policy="prefix_aware", **kw)
    h = _run(items, policy="prefix_aware", params=PolicyParams(placement="hash"), **kw)
    assert p["kv_hit_rate"] > r["kv_hit_rate"] + 0.1  # type: ignore[operator]
    assert p["decisions"].get("affinity", 0) > 250  # type: ignore[attr-defined]
    assert h["decisions"] == {"affinity": 300}


def test_config_errors_name_the_fix() -> None:
    """Bad fleet settings fail with messages that say what to give."""
    with pytest.raises(ConfigError, match="either concurrency"):
        RoutingConfig(instances=2, profile=TINY, policy="random", concurrency=2, rate=1.0)
    with pytest.raises(ConfigError, match="need a concurrency"):
        _run(_items("unique", 3))
    with pytest.raises(ConfigError, match="unknown"):
        _run(_items("unique", 3), policy="nope", concurrency=1)


def test_a_seeded_run_gives_the_figures_it_gave_before_the_speedups() -> None:
    """A seeded run under KV pressure (preemptions, evictions) reproduces the figures the
    code gave before the KV free list, tokenizer and scheduler were made faster (pinned to
    the placement those figures were taken with, ``learned``)."""
    params = PolicyParams(placement="learned")
    s = _run(_items("rag", 400), kv_blocks=300, concurrency=16, params=params)
    assert (s["preemptions"], s["steps"], s["events"]) == (90, 5327, 5327)
    assert s["decisions"] == {"affinity": 396, "fallback": 1, "spill": 3}
    assert s["kv_hit_rate"] == pytest.approx(0.32381671802007755, rel=1e-12)
    assert s["ttft_p50_ms"] == pytest.approx(63.84698511999864, rel=1e-9)
    assert s["ttft_p99_ms"] == pytest.approx(139.34905587839978, rel=1e-9)
    assert s["virtual_s"] == pytest.approx(2.8879562622200026, rel=1e-9)


def test_thousands_of_refused_requests_do_not_recurse() -> None:
    """Every request refused (each releasing its client at once) is counted, no crash."""
    big = [SimItem(f"r{i}", "/v1/completions", {"prompt": [7] * 200, "max_tokens": 4})
           for i in range(1200)]  # fmt: skip
    s = _run(big, concurrency=2, kv_blocks=10)
    assert s["errors"] == 1200 and s["requests"] == 1200
    assert sum(s["decisions"].values()) == 1200  # type: ignore[attr-defined]


def test_a_seeded_run_under_the_stable_placement_gives_its_pinned_figures() -> None:
    """The same run under the ``stable`` placement (the router's default until issue 14's
    movedefault; test_decision_pins.py pins the new default's figures) reproduces its
    own pinned figures."""
    s = _run(
        _items("rag", 400), kv_blocks=300, concurrency=16, params=PolicyParams(placement="stable")
    )
    assert (s["preemptions"], s["steps"], s["events"]) == (54, 5008, 5008)
    assert s["decisions"] == {"affinity": 396, "fallback": 4}
    assert s["kv_hit_rate"] == pytest.approx(0.451909025949363, rel=1e-12)
    assert s["ttft_p50_ms"] == pytest.approx(12.802323139999627, rel=1e-9)
    assert s["ttft_p99_ms"] == pytest.approx(219.94415992659827, rel=1e-9)
    assert s["virtual_s"] == pytest.approx(2.8130415100999975, rel=1e-9)


def test_the_cli_routes_with_the_routers_default_placement() -> None:
    """``preheat sim routing`` without --placement routes as a router with default
    parameters does (stable-move), not as the learned placement it used to default to."""
    args = ["sim", "routing", "--instances", "3", "--profile", "tiny", "--policy",
            "prefix_aware", "--workload", "rag", "--requests", "40", "--concurrency", "6",
            "--kv-blocks", "300", "--seed", "3", "--json"]  # fmt: skip

    def run(*extra: str) -> str:
        out = CliRunner().invoke(main, [*args, *extra])
        assert out.exit_code == 0, out.output
        return out.output

    default = run()
    assert default == run("--placement", PolicyParams().placement)
    assert default != run("--placement", "learned")
