"""The router's cached prompt -> block hashes path and the precise index's mask walk give
exactly what the uncached, per-instance computation gives."""

from __future__ import annotations

import random

from preheat.bench.workloads import WORKLOADS
from preheat.kvcache import block_hashes
from preheat.kvhash import HashScheme
from preheat.router.kvprecise import PreciseIndex, prompt_tokens
from preheat.router.kvprompt import EngineCodec, PromptBlocks


def test_chunked_cached_hashes_equal_the_engines_whole_prompt_hashes() -> None:
    """For RAG/chat and code bodies, with and without a cache_salt, the chunk-cached hashes
    equal kvcache.block_hashes over the whole tokenized prompt, and a repeat hits."""
    pb = PromptBlocks(EngineCodec(), HashScheme("builtin"))
    bodies = [w.body for w in WORKLOADS["rag_chat"](40, seed=3)]
    bodies += [w.body for w in WORKLOADS["code_completion"](40, seed=3)]
    bodies.append({**bodies[0], "cache_salt": "tenant-a"})
    for body in bodies:
        toks = prompt_tokens(body)
        assert toks is not None
        salt = body.get("cache_salt")
        want = block_hashes(toks, 16, salt=salt)
        got = pb.blocks(body)
        assert got == (want, len(toks))
    misses = pb.misses
    assert pb.blocks(bodies[5]) is not None and pb.misses == misses and pb.hits > 0


def test_cache_entries_read_alike_after_hits_misses_and_evictions() -> None:
    """With a cache too small for the stream (entries evicted, so a prompt mixes cached and
    new chunks in any order), every body still gets the uncached hashes and token count,
    also when its last chunk was the cached one."""
    bodies = [w.body for w in WORKLOADS["rag_chat"](60, seed=5)]
    bodies += [w.body for w in WORKLOADS["chat"](60, seed=5)]
    random.Random(5).shuffle(bodies)
    for size in (3, 40, 1 << 15):
        pb = PromptBlocks(EngineCodec(), HashScheme("builtin"), max_chunks=size)
        # Each body twice in a row: the second time every chunk is cached.
        for body in [b for b in bodies for _ in (0, 1)] + bodies[::3]:
            toks = prompt_tokens(body)
            assert toks is not None
            assert pb.blocks(body) == (block_hashes(toks, 16), len(toks))
        assert pb.misses > 0 and (pb.hits > 0 or size < 5)


def test_mask_walk_matches_a_per_instance_loop() -> None:
    """Random announced and pending sets on 70 instances (over one 64-bit word): each
    instance's held run equals the leading run of the prompt's hashes in its sets."""
    rng = random.Random(7)
    ix = PreciseIndex()
    ids = [f"i{k}" for k in range(70)]
    body = {"prompt": " ".join(f"word{k}" for k in range(600))}
    hashes, _ = ix.default_prompt.blocks(body) or ([], 0)
    assert len(hashes) > 50
    for x in ids:
        ix.add(x)
        ix.apply(x, 0, [["AllBlocksCleared"]])
        n = rng.randrange(len(hashes) + 1)
        stored = [h for h in hashes[:n] if rng.random() > 0.05]
        ix.apply(x, 1, [["BlockStored", stored, None, [], 16, None, "GPU"]])
        if rng.random() < 0.3:
            ix.apply(x, 2, [["BlockRemoved", stored[: rng.randrange(len(stored) + 1)], "GPU"]])
    lk = ix.lookup(body, ids)
    assert lk is not None
    # Pending: one instance is sent the prompt; its unannounced blocks count as held.
    ix.sent("i3", lk)
    lk = ix.lookup(body, ids)
    assert lk is not None and lk.held["i3"] == len(hashes)
    for x in ids:
        ib = ix.instances[x]
        n = 0
        for h in hashes:
            if h not in ib.blocks and h not in ib.pending:
                break
            n += 1
        assert lk.held[x] == n, x
    # A fallback drops the instance's bits: the others' runs are unchanged.
    ix.lost("i3", "test")
    lk2 = ix.lookup(body, ids)
    assert lk2 is not None and "i3" not in lk2.held
    assert all(lk2.held[x] == lk.held[x] for x in ids if x != "i3")


def test_held_runs_read_as_the_per_instance_map() -> None:
    """The runs a lookup keeps answer who holds at least c characters, what one instance
    holds and the whole map exactly as the per-instance ``held_chars`` map does."""
    rng = random.Random(11)
    ix = PreciseIndex()
    ids = [f"i{k}" for k in range(70)]
    body = {"prompt": " ".join(f"word{k}" for k in range(600))}
    hashes, _ = ix.default_prompt.blocks(body) or ([], 0)
    for x in ids[:-1]:  # the last is never synced
        ix.add(x)
        ix.apply(x, 0, [["AllBlocksCleared"]])
        n = rng.choice([0, 1, 5, 5, 17, len(hashes)])
        ix.apply(x, 1, [["BlockStored", hashes[:n], None, [], 16, None, "GPU"]])
    ix.add(ids[-1])
    lk = ix.lookup(body, ids)
    assert lk is not None and lk.runs is not None and len(lk.runs) == 4
    prompt_chars = len(body["prompt"])
    want = lk.held_chars(prompt_chars)
    got = lk.chars(prompt_chars)
    assert dict(got.items()) == want and len(want) < len(ids) - 1
    for x in ids:
        assert got.get(x) == want.get(x), x
        assert lk.held_of(x) == lk.held.get(x, 0), x
    for c in (0.5, 1, *sorted(set(want.values())), prompt_chars + 1):
        assert sorted(got.at_least(c)) == sorted(x for x, v in want.items() if v >= c), c
