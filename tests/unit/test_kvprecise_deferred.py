"""The precise index's deferred pending marks (``sent`` queues, the next read or write
flushes) give exactly the lookups and sets that marking them at once gives."""

from __future__ import annotations

import random

import pytest

from preheat.bench.workloads import WORKLOADS
from preheat.router import kvprecise
from preheat.router.kvprecise import PreciseIndex


def _state(ix: PreciseIndex) -> tuple[object, ...]:
    """Everything the pending marks touch: masks, and per instance its sets and flags."""
    per = {
        x: (ib.state, frozenset(ib.blocks), tuple(ib.pending), ib.owes_events, ib.last_seq)
        for x, ib in ix.instances.items()
    }
    return dict(ix._mask), per


@pytest.mark.parametrize("max_pending", [kvprecise.MAX_PENDING, 150])
def test_deferred_pending_equals_pending_written_at_once(
    monkeypatch: pytest.MonkeyPatch, max_pending: int
) -> None:
    """A seeded stream of lookups, sends, BlockStored/BlockRemoved batches, clears, gaps,
    losses and re-adds over 6 instances: an index that flushes right after every ``sent``
    (the marks written at once) and one that defers them agree on every lookup's held
    runs and on every set, mask and flag after every step (also past MAX_PENDING)."""
    monkeypatch.setattr(kvprecise, "MAX_PENDING", max_pending)
    rng = random.Random(5)
    bodies = [w.body for w in WORKLOADS["rag_chat"](120, seed=9)]
    ids = tuple(f"i{k}" for k in range(6))
    eager, lazy = PreciseIndex(), PreciseIndex()
    seq = dict.fromkeys(ids, 1)
    for ix in (eager, lazy):
        for x in ids:
            ix.add(x)
            ix.apply(x, 0, [["AllBlocksCleared"]])
    sent = 0
    for k, body in enumerate(bodies):
        a, b = eager.lookup(body, ids), lazy.lookup(body, ids)
        assert a is not None and b is not None
        assert (a.hashes, a.runs, dict(a.held)) == (b.hashes, b.runs, dict(b.held)), k
        x = rng.choice(ids)
        eager.sent(x, a)
        eager.flush()
        lazy.sent(x, b)
        sent += bool(lazy._owed)
        r = rng.random()
        if r < 0.5:
            # The engine stores a leading part of the prompt (maybe later than asked).
            y = x if rng.random() < 0.8 else rng.choice(ids)
            got = lazy.default_prompt.blocks(body)
            assert got is not None
            ev = [["BlockStored", got[0][: rng.randrange(len(got[0]) + 1)], None, [], 16]]
            if rng.random() < 0.2 and lazy.instances[y].blocks:
                ev.append(["BlockRemoved", list(lazy.instances[y].blocks)[:5], "GPU"])
            s = seq[y] + (3 if rng.random() < 0.03 else 0)  # now and then a gap
            seq[y] = s + 1
            for ix in (eager, lazy):
                ix.apply(y, s, ev)
        elif r < 0.55:
            y = rng.choice(ids)
            for ix in (eager, lazy):
                ix.apply(y, seq[y], [["AllBlocksCleared"]])
            seq[y] += 1
        elif r < 0.58:
            y = rng.choice(ids)
            for ix in (eager, lazy):
                ix.lost(y, "test")
        elif r < 0.6:
            y = rng.choice(ids)
            for ix in (eager, lazy):
                ix.remove(y)
                ix.add(y)
                ix.apply(y, 0, [["AllBlocksCleared"]])
            seq[y] = 1
        lazy.flush()
        assert _state(eager) == _state(lazy), k
    assert sent > 60
    if max_pending < kvprecise.MAX_PENDING:
        assert any(len(ib.pending) == max_pending for ib in lazy.instances.values())


def test_sent_defers_the_marks_until_the_next_lookup() -> None:
    """``sent`` writes no pending mark but flags the owed events; the next lookup sees the
    sent prompt as held on its instance."""
    ix = PreciseIndex()
    body = WORKLOADS["rag_chat"](1, seed=2)[0].body
    ids = ("a", "b")
    for x in ids:
        ix.add(x)
        ix.apply(x, 0, [["AllBlocksCleared"]])
    lk = ix.lookup(body, ids)
    assert lk is not None and lk.held_of("a") == 0
    ix.sent("a", lk)
    assert ix.instances["a"].owes_events and not ix.instances["a"].pending
    again = ix.lookup(body, ids)
    assert again is not None and again.held_of("a") == len(lk.hashes) > 0
    assert again.held_of("b") == 0 and len(ix.instances["a"].pending) == len(lk.hashes)
