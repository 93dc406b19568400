"""Engine timing profiles: the step-time model and the named profiles."""

from __future__ import annotations

import pytest

from preheat.timing import PROFILES, StepWork, get_profile, prefill_attn_pairs


def test_required_profiles_exist() -> None:
    """The issue's four profiles are registered and sane."""
    for name in ("llama-3.1-70b-8xh100", "llama-3.1-8b-1xh100", "qwen3-32b-1xh200", "tiny"):
        p = get_profile(name)
        assert p.kv_capacity_tokens % p.block_size == 0
        assert p.kv_blocks * p.block_size == p.kv_capacity_tokens
        assert p.weights_bytes > 0 and p.max_model_len > 0
        assert p.source


def test_unknown_profile_names_choices() -> None:
    """A typo lists the valid names."""
    with pytest.raises(KeyError, match="tiny"):
        get_profile("llama-70b")


def test_derived_figures_of_the_70b_profile() -> None:
    """70B on 8xH100: 141 GB weights, 320 KiB KV per token, decode ~10 ms, prefill ~22k tok/s."""
    p = PROFILES["llama-3.1-70b-8xh100"]
    assert p.weights_bytes == pytest.approx(141.2e9)
    assert p.kv_bytes_per_token == 327_680
    assert 1.0e6 < p.kv_capacity_tokens < 1.4e6
    assert 0.008 < p.decode_step_time(1, 1000) < 0.015
    assert 15_000 < p.prefill_tokens_per_s < 30_000


def test_decode_is_memory_bound_until_compute_catches_up() -> None:
    """Adding sequences to a decode step costs only their KV reads while weights dominate."""
    p = PROFILES["llama-3.1-70b-8xh100"]
    t1 = p.decode_step_time(1, 0)
    t64 = p.decode_step_time(64, 0)
    assert t64 == pytest.approx(t1)
    assert p.decode_step_time(64, 4000) > t64
    t1000 = p.decode_step_time(1000, 0)
    assert t1000 == pytest.approx(p.step_overhead_s + 1000 * p.token_compute_s)


def test_step_time_formula() -> None:
    """A mixed step adds overhead, the larger of weight read and compute, and attention."""
    p = PROFILES["tiny"]
    w = StepWork(
        prefill_tokens=1000, prefill_attn_pairs=5000, decode_seqs=10, decode_context_tokens=700
    )
    expected = (
        p.step_overhead_s
        + max(p.weight_read_s, 1010 * p.token_compute_s)
        + 5000 * p.attn_pair_s
        + 700 * p.kv_read_s
    )
    assert p.step_time(w) == pytest.approx(expected)
    assert p.step_time(StepWork()) == 0.0


def test_attention_pairs_are_causal() -> None:
    """n tokens after s cached ones attend to n*s + n(n+1)/2 positions."""
    assert prefill_attn_pairs(0, 1) == 1
    assert prefill_attn_pairs(0, 4) == 10
    assert prefill_attn_pairs(8, 2) == 8 * 2 + 3


def test_prefill_time_chunks_and_cached_prefix() -> None:
    """A cached prefix leaves one short step; a cold prompt costs one step per chunk."""
    p = PROFILES["tiny"]
    cold = p.prefill_time(8100)
    warm = p.prefill_time(8100, cached_tokens=8000)
    assert warm < cold / 5
    # Chunking: 8100 tokens at 2048 per step is 4 full chunks plus 1 remainder.
    steps = [2048, 2048, 2048, 1956]
    done, total = 0, 0.0
    for n in steps:
        total += p.step_time(
            StepWork(prefill_tokens=n, prefill_attn_pairs=prefill_attn_pairs(done, n))
        )
        done += n
    assert cold == pytest.approx(total)
    # Even a fully cached prompt computes its last token.
    assert p.prefill_time(100, cached_tokens=100) == pytest.approx(
        p.step_time(StepWork(prefill_tokens=1, prefill_attn_pairs=100))
    )
