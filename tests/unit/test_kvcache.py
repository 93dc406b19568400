"""The prefix KV cache against hand-computed cases (vLLM automatic prefix caching)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from preheat.kvcache import KVCache, block_hashes, root_hash

BS = 4  # small blocks keep the hand-computed cases readable


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run(kv: KVCache, seq: str, tokens: list[int]) -> int:
    """Admit a whole prompt in one step, compute it, and return the cached token count."""
    hashes = kv.hashes(tokens)
    cached = kv.allocate_prompt(seq, hashes, len(tokens), len(tokens))
    assert cached is not None
    kv.commit(seq, hashes, len(tokens))
    return cached


def test_only_full_blocks_are_hashed() -> None:
    """10 tokens in blocks of 4 give two hashes; the partial third block has none."""
    assert len(block_hashes(toks(10), BS)) == 2
    assert len(block_hashes(toks(12), BS)) == 3
    assert block_hashes(toks(3), BS) == []


def test_chain_identity_depends_on_prefix() -> None:
    """The same block tokens after a different prefix hash differently."""
    a = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], BS)
    b = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], BS)
    assert a[1] != b[1]
    assert block_hashes([9, 9, 9, 9], BS)[0] not in (a[1], b[1])
    # Extending a chain from a parent equals hashing the whole sequence.
    assert block_hashes([9, 9, 9, 9], BS, parent=a[0]) == [a[1]]


def test_hashes_are_stable_across_processes() -> None:
    """Another interpreter (another hash seed) computes the same chain."""
    code = "from preheat.kvcache import block_hashes; print(block_hashes(list(range(40)), 16, salt='s'))"
    env_out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    ).stdout.strip()
    assert env_out == str(block_hashes(list(range(40)), 16, salt="s"))


def test_salt_gives_disjoint_chain() -> None:
    """A cache_salt changes every block's identity."""
    assert root_hash("tenant-a") != root_hash("tenant-b") != root_hash()
    assert block_hashes(toks(8), BS, salt="a") != block_hashes(toks(8), BS)


def test_hit_on_full_leading_blocks_only() -> None:
    """A second prompt sharing 9 tokens reuses the two full blocks (8 tokens), not the ninth."""
    kv = KVCache(16, BS)
    assert run(kv, "a", toks(12)) == 0
    kv.free("a")
    assert run(kv, "b", [*toks(9), 100, 101, 102]) == 8
    assert (kv.queries, kv.hits) == (24, 8)


def test_a_match_passed_in_admits_as_a_fresh_lookup_does() -> None:
    """``allocate_prompt(hit=match(...))`` (the scheduler's admission) reuses, counts and
    refcounts exactly as the lookup it saves: the same cached tokens, counters and state."""
    a, b = KVCache(16, BS), KVCache(16, BS)
    for kv in (a, b):
        run(kv, "a", toks(12))
        kv.free("a")
    prompt = [*toks(9), 100, 101, 102]
    ha, hb = a.hashes(prompt), b.hashes(prompt)
    assert a.allocate_prompt("b", ha, len(prompt), len(prompt)) == 8
    assert b.allocate_prompt("b", hb, len(prompt), len(prompt), hit=b.match(hb, len(prompt))) == 8
    assert a.stats() == b.stats() and (a.queries, a.hits) == (b.queries, b.hits) == (24, 8)
    a.commit("b", ha, len(prompt))
    b.commit("b", hb, len(prompt))
    a.free("b")
    b.free("b")
    assert run(a, "c", prompt) == run(b, "c", prompt) == 8
    assert a.stats() == b.stats()


def test_fully_cached_prompt_recomputes_last_block() -> None:
    """An identical 12-token prompt reuses 8 tokens: the last token must be computed."""
    kv = KVCache(16, BS)
    run(kv, "a", toks(12))
    kv.free("a")
    assert run(kv, "b", toks(12)) == 8
    # 13 tokens: 3 full blocks cached, the 13th is new.
    kv.free("b")
    assert run(kv, "c", toks(13)) == 12


def test_same_block_after_different_prefix_is_no_hit() -> None:
    """Block [9,9,9,9] cached after prefix A is not a hit after prefix B."""
    kv = KVCache(16, BS)
    run(kv, "a", [1, 2, 3, 4, 9, 9, 9, 9, 0])
    kv.free("a")
    assert run(kv, "b", [5, 6, 7, 8, 9, 9, 9, 9, 0]) == 0


def test_refcounts_protect_running_sequences() -> None:
    """Blocks shared by two running sequences survive one of them ending; usage counts them once."""
    kv = KVCache(4, BS)
    run(kv, "a", toks(8))  # 2 blocks
    assert kv.free_blocks == 2
    assert run(kv, "b", [*toks(8), 50]) == 8  # shares both, needs 1 more
    assert kv.free_blocks == 1
    kv.free("a")
    assert kv.free_blocks == 1  # still referenced by b
    # A new 8-token unrelated prompt needs 2 blocks; only 1 is free.
    assert kv.allocate_prompt("c", kv.hashes(toks(8, 100)), 8, 8) is None
    assert "c" not in kv
    assert (kv.queries, kv.hits) == (17, 8)  # failed admission is not counted
    kv.free("b")
    assert kv.free_blocks == 4


def test_lru_evicts_least_recently_freed_first() -> None:
    """A new prompt takes the empty block first, then evicts the least recently freed cached one."""
    kv = KVCache(2, BS)
    p1, p2 = toks(5, 0), toks(5, 10)  # 2 blocks each while running
    run(kv, "1", p1)
    kv.free("1")
    # p1's full block (cached) and its partial block (empty) are free; p2 takes both,
    # the empty one first, then evicts p1's block.
    run(kv, "2", p2)
    kv.free("2")
    assert kv.evictions == 1
    assert kv.cached_tokens(kv.hashes(p1), 5) == 0
    assert kv.cached_tokens(kv.hashes(p2), 5) == 4


def test_lru_order_follows_reuse() -> None:
    """Touching a cached prefix makes it most recent, so the other one is evicted."""
    kv = KVCache(3, BS)
    a, b = toks(4, 0), toks(4, 10)
    run(kv, "a", [*a, 1])
    kv.free("a")
    run(kv, "b", [*b, 1])
    kv.free("b")
    run(kv, "a2", [*a, 2])  # reuses a's block: a is now more recent than b
    kv.free("a2")
    run(kv, "c", toks(8, 20))  # needs 2 new blocks: 1 empty + evict the LRU cached one (b)
    kv.free("c")
    assert kv.cached_tokens(kv.hashes([*a, 3]), 5) == 4
    assert kv.cached_tokens(kv.hashes([*b, 3]), 5) == 0


def test_tail_blocks_are_evicted_before_head_blocks() -> None:
    """A freed sequence's last block goes first, keeping its shareable start."""
    kv = KVCache(3, BS)
    run(kv, "a", toks(12))  # 3 full blocks
    kv.free("a")
    run(kv, "b", toks(4, 100))  # 1 block: evicts a's third block
    assert kv.cached_tokens(kv.hashes([*toks(8), 0]), 9) == 8


def test_chunked_growth_and_commit() -> None:
    """A prompt admitted in chunks registers only computed full blocks."""
    kv = KVCache(8, BS)
    prompt = toks(14)
    hashes = kv.hashes(prompt)
    assert kv.allocate_prompt("s", hashes, 14, 6) == 0
    assert kv.seq_blocks("s") == 2
    kv.commit("s", hashes, 6)  # one full block computed
    assert kv.cached_tokens(kv.hashes(toks(9)), 9) == 4
    assert kv.grow("s", 14)
    kv.commit("s", hashes, 14)
    assert kv.seq_blocks("s") == 4
    assert kv.cached_tokens(kv.hashes(toks(13)), 13) == 12
    assert not kv.grow("s", 14 + 4 * 5)  # would need 5 more blocks; 4 free
    assert kv.seq_blocks("s") == 4


def test_stats_and_usage() -> None:
    """Usage is referenced blocks over capacity; hit rate is hits over queries."""
    kv = KVCache(10, BS)
    run(kv, "a", toks(8))
    st = kv.stats()
    assert st.usage == pytest.approx(0.2)
    assert st.cached_blocks == 2
    kv.free("a")
    run(kv, "b", toks(9))
    st = kv.stats()
    assert (st.queries, st.hits) == (17, 8)
    assert st.hit_rate == pytest.approx(8 / 17)


def test_reset_drops_unreferenced_prefixes_only() -> None:
    """reset() forgets free cached blocks but keeps those a running sequence holds."""
    kv = KVCache(10, BS)
    run(kv, "a", toks(8))
    run(kv, "b", toks(8, 100))
    kv.free("a")
    kv.reset()
    assert kv.cached_tokens(kv.hashes(toks(9)), 9) == 0
    assert kv.cached_tokens(kv.hashes(toks(9, 100)), 9) == 8


def test_disabled_prefix_caching_never_hits() -> None:
    """With prefix caching off every prompt is computed in full."""
    kv = KVCache(10, BS, enable_prefix_caching=False)
    run(kv, "a", toks(8))
    kv.free("a")
    assert run(kv, "b", toks(9)) == 0


def test_bad_arguments() -> None:
    """Zero capacity and double admission are refused with a message."""
    with pytest.raises(ValueError, match="num_blocks 0"):
        KVCache(0)
    kv = KVCache(4, BS)
    run(kv, "a", toks(4))
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate_prompt("a", [], 1, 1)
    assert kv.free("unknown") == 0


def test_free_queue_order_is_empty_then_unused_then_cached_lru() -> None:
    """Allocation takes freed empty blocks (newest first), then never-used ones, then
    evicts cached blocks least recently freed first, each tail block before its head."""
    kv = KVCache(8, block_size=2)
    a = [1, 2, 3, 4]
    ha = kv.hashes(a)
    assert kv.allocate_prompt("a", ha, 4, 4) == 0
    kv.commit("a", ha, 4)
    assert kv.allocate_prompt("b", kv.hashes([5, 6, 7]), 3, 3) == 0  # never committed
    assert kv.free_blocks == 4
    kv.free("b")
    kv.free("a")
    assert kv.free_blocks == 8
    c = list(range(100, 116))
    assert kv.allocate_prompt("c", kv.hashes(c), 16, 16) == 0
    assert kv._seqs["c"] == [2, 3, 4, 5, 6, 7, 1, 0]
    assert kv.evictions == 2 and kv.stats().cached_blocks == 0


def test_a_large_pool_is_lazy_and_exact() -> None:
    """A pool of two million blocks starts with every block free and hands out ids 0, 1,
    2 ... in order, without listing them first."""
    kv = KVCache(2_000_000)
    assert kv.free_blocks == 2_000_000 and kv.usage == 0.0
    toks = list(range(1000, 1000 + 48))
    assert kv.allocate_prompt("s", kv.hashes(toks), 48, 48) == 0
    assert kv._seqs["s"] == [0, 1, 2] and kv.free_blocks == 2_000_000 - 3
