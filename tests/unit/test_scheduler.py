"""The continuous-batching scheduler on virtual time."""

from __future__ import annotations

import dataclasses
import random

import pytest

from preheat.engine.core.scheduler import Scheduler
from preheat.engine.core.tokenizer import Tokenizer
from preheat.errors import PromptTooLong
from preheat.timing import PROFILES, StepWork

TINY = PROFILES["tiny"]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 120_000 + 1000 for i in range(n)]


def test_cached_8k_prefix_ttft_matches_profile_prediction() -> None:
    """A request whose 8,000-token prefix is cached gets its first token far sooner, as predicted."""
    s = Scheduler(TINY)
    shared = prompt(8000, seed=1)
    s.add_request("cold", [*shared, *prompt(100, seed=2)], max_tokens=1, arrival=0.0)
    t_cold_end, _ = s.run_until_idle(0.0)
    cold = s.kv.stats()

    s.add_request("warm", [*shared, *prompt(100, seed=3)], max_tokens=1, arrival=t_cold_end)
    t_warm_end, outs = s.run_until_idle(t_cold_end)
    ttft_cold = t_cold_end
    ttft_warm = t_warm_end - t_cold_end

    assert outs[0].num_cached_tokens == 8000  # 500 full blocks of 16
    assert s.kv.hits - cold.hits == 8000
    assert ttft_cold == pytest.approx(TINY.prefill_time(8100))
    assert ttft_warm == pytest.approx(TINY.prefill_time(8100, cached_tokens=8000))
    assert ttft_cold / ttft_warm > 5
    assert ttft_cold / ttft_warm == pytest.approx(
        TINY.prefill_time(8100) / TINY.prefill_time(8100, cached_tokens=8000)
    )


def test_chunked_prefill_respects_token_budget() -> None:
    """A 5,000-token prompt takes ceil(5000/2048) steps before its first token."""
    s = Scheduler(TINY)
    s.add_request("a", prompt(5000), max_tokens=2, arrival=0.0)
    chunks = []
    while (step := s.schedule()) is not None:
        chunks.append(step.work.prefill_tokens)
        s.complete(step, 0.0)
    assert chunks == [2048, 2048, 904, 0]
    assert s.generation_tokens_total == 2


def test_decode_batches_and_outputs_follow_max_tokens() -> None:
    """Concurrent requests decode together, each producing exactly max_tokens tokens."""
    s = Scheduler(TINY)
    for i in range(4):
        s.add_request(i, prompt(50, seed=i), max_tokens=3 + i, arrival=0.0)
    first = s.schedule()
    assert first is not None and first.work.prefill_tokens == 200
    s.complete(first, 1.0)
    second = s.schedule()
    assert second is not None
    assert (second.work.decode_seqs, second.work.prefill_tokens) == (4, 0)
    assert second.work.decode_context_tokens == 4 * 51
    s.complete(second, 2.0)
    _, outs = s.run_until_idle(2.0)
    finals = {o.req_id: o for o in outs if o.finished}
    assert {k: v.num_output_tokens for k, v in finals.items()} == {0: 3, 1: 4, 2: 5, 3: 6}
    assert s.kv.free_blocks == s.kv.num_blocks
    assert not s.has_work


def test_max_num_seqs_limits_running() -> None:
    """No more than max_num_seqs sequences run at once; the rest wait."""
    s = Scheduler(TINY, max_num_seqs=2)
    for i in range(5):
        s.add_request(i, prompt(20, seed=i), max_tokens=4, arrival=0.0)
    step = s.schedule()
    assert step is not None
    assert (s.num_running, s.num_waiting) == (2, 3)
    s.complete(step, 0.1)
    _, outs = s.run_until_idle(0.1)
    assert sum(o.finished for o in outs) == 5


def test_admission_waits_for_free_blocks() -> None:
    """A prompt that does not fit the free blocks waits until a running one finishes."""
    s = Scheduler(TINY, kv_blocks=10)  # 160 token slots
    s.add_request("a", prompt(100, seed=1), max_tokens=10, arrival=0.0)
    s.add_request("b", prompt(100, seed=2), max_tokens=10, arrival=0.0)
    step = s.schedule()
    assert step is not None
    assert [seq.req_id for seq, _ in step.scheduled] == ["a"]
    assert s.num_waiting == 1
    _, outs = s.run_until_idle(0.0)
    order = [o.req_id for o in outs if o.finished]
    assert order == ["a", "b"]


def test_preemption_recomputes_newest_sequence() -> None:
    """When decode runs out of blocks the newest sequence is preempted and later recomputed."""
    s = Scheduler(TINY, kv_blocks=6)  # 96 slots
    s.add_request("old", prompt(40, seed=1), max_tokens=30, arrival=0.0)
    s.add_request("new", prompt(40, seed=2), max_tokens=30, arrival=0.0)
    _, outs = s.run_until_idle(0.0)
    assert s.num_preemptions >= 1
    finished = [o for o in outs if o.finished]
    assert [o.req_id for o in finished] == ["old", "new"]
    assert all(o.num_output_tokens == 30 for o in finished)
    assert s.kv.free_blocks == 6


def test_abort_frees_blocks() -> None:
    """Aborting a running request releases its blocks immediately, and its step result is dropped."""
    s = Scheduler(TINY)
    s.add_request("x", prompt(300), max_tokens=50, arrival=0.0)
    step = s.schedule()
    assert step is not None and s.kv.free_blocks < s.kv.num_blocks
    assert s.abort("x")
    assert s.kv.free_blocks == s.kv.num_blocks
    assert s.complete(step, 1.0) == []
    assert not s.abort("x")


def test_prompt_too_long_is_refused() -> None:
    """Prompt plus max_tokens above the context, or above KV capacity, is a PromptTooLong."""
    s = Scheduler(TINY)
    with pytest.raises(PromptTooLong, match="maximum context length is 32768"):
        s.add_request("big", prompt(32760), max_tokens=16, arrival=0.0)
    small = Scheduler(TINY, kv_blocks=4)
    with pytest.raises(PromptTooLong, match="--kv-blocks"):
        small.add_request("big", prompt(100), max_tokens=1, arrival=0.0)


def test_step_duration_comes_from_profile() -> None:
    """Each step's duration is the profile's step_time of its work."""
    slow = dataclasses.replace(TINY, step_overhead_s=1.0)
    s = Scheduler(slow)
    s.add_request("a", prompt(64), max_tokens=2, arrival=0.0)
    step = s.schedule()
    assert step is not None
    assert step.duration == pytest.approx(
        slow.step_time(StepWork(prefill_tokens=64, prefill_attn_pairs=64 * 65 // 2))
    )


def test_output_blocks_become_cached_for_the_next_turn() -> None:
    """Generated tokens fill blocks that a follow-up prompt (prompt + answer) can hit."""
    s = Scheduler(TINY)
    p = prompt(32, seed=5)
    # 32 prompt + 17 output tokens: the last sampled token is never computed, so 48
    # tokens (3 blocks) hold KV.
    s.add_request("t1", p, max_tokens=17, arrival=0.0)
    s.run_until_idle(0.0)
    kv = s.kv  # the answer's tokens are the deterministic filler ids
    follow = [*p, *Tokenizer.filler_ids(0, 16), *prompt(20, seed=6)]
    assert kv.cached_tokens(kv.hashes(follow), len(follow)) == 48


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_invariants(seed: int) -> None:
    """Random shared-prefix traffic with aborts under tight KV: every survivor gets max_tokens, nothing leaks."""
    rng = random.Random(seed)
    s = Scheduler(TINY, kv_blocks=rng.choice([12, 24, 64]), max_num_seqs=rng.choice([2, 4, 16]))
    docs = [prompt(rng.randrange(16, 120), seed=100 + i) for i in range(3)]
    expected: dict[int, int] = {}
    got: dict[int, int] = {}
    now = 0.0
    next_id = 0
    for _ in range(400):
        if rng.random() < 0.3 and next_id < 60:
            p = [*rng.choice(docs), *prompt(rng.randrange(1, 40), seed=next_id)]
            mt = rng.randrange(1, 30)
            try:
                s.add_request(next_id, p, mt, now)
                expected[next_id] = mt
            except PromptTooLong:
                pass
            next_id += 1
        if rng.random() < 0.05 and expected:
            victim = rng.choice(sorted(expected))
            if s.abort(victim):
                expected.pop(victim)
        step = s.schedule()
        if step is None:
            continue
        now += step.duration
        for o in s.complete(step, now):
            assert o.req_id in expected
            if o.finished:
                got[o.req_id] = o.num_output_tokens
        st = s.kv.stats()
        assert 0 <= st.free_blocks <= st.num_blocks
        assert st.hits <= st.queries
        assert s.num_running <= s.max_num_seqs
    now, outs = s.run_until_idle(now)
    got.update({o.req_id: o.num_output_tokens for o in outs if o.finished})
    assert got == expected
    assert s.kv.free_blocks == s.kv.num_blocks
    assert not s.has_work
