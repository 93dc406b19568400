"""The pure fan-out planner: origin budget, peer fills, determinism, and peer ranking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.control.fanout import Budget, Candidate, Mode, WarmRequest, plan_fanout, rank_peers

NODES = [f"n{i}" for i in range(8)]
REVS = ["r1", "r2"]
BLOBS = {"r1": frozenset({"a", "b", "c"}), "r2": frozenset({"c", "d"})}


@st.composite
def worlds(draw):  # type: ignore[no-untyped-def]
    """Requests, holdings, running origin fills and a budget, consistent with each other."""
    complete = {n: frozenset(draw(st.sets(st.sampled_from("abcd")))) for n in NODES}
    requests = []
    for n in draw(st.sets(st.sampled_from(NODES))):
        rev = draw(st.sampled_from(REVS))
        missing = BLOBS[rev] - complete[n]
        if missing:
            requests.append(WarmRequest(n, rev, frozenset(missing)))
    running = {
        (r.node, r.revision) for r in requests if draw(st.booleans()) and draw(st.booleans())
    }
    fills = draw(st.one_of(st.none(), st.integers(1, 4)))
    return requests, complete, running, Budget(concurrent_fills=fills)


def _origin(out: dict[tuple[str, str], Mode]) -> list[tuple[str, str]]:
    return [k for k, m in out.items() if m is Mode.ORIGIN]


@given(worlds())
@settings(max_examples=60, deadline=None)
def test_origin_fills_stay_within_the_budget(world) -> None:  # type: ignore[no-untyped-def]
    """New origin fills are granted only while the budget has room: at most
    ``concurrent_fills`` over the cluster, or one per revision without a budget."""
    requests, complete, running, budget = world
    out = plan_fanout(requests, complete, running, budget)
    fresh = [k for k in _origin(out) if k not in running]
    if budget.concurrent_fills is None:
        for rev in REVS:
            n = sum(1 for _, r in _origin(out) if r == rev)
            assert not fresh or n <= max(1, sum(1 for _, r in running if r == rev))
            assert not [k for k in fresh if k[1] == rev] or n == 1
    else:
        assert not fresh or len(_origin(out)) <= budget.concurrent_fills


@given(worlds())
@settings(max_examples=60, deadline=None)
def test_peer_mode_only_when_every_missing_blob_has_a_complete_holder(world) -> None:  # type: ignore[no-untyped-def]
    """A node is sent to peers only if another node holds each blob it lacks, complete."""
    requests, complete, running, budget = world
    out = plan_fanout(requests, complete, running, budget)
    for r in requests:
        if out[(r.node, r.revision)] is Mode.PEER:
            for d in r.missing:
                assert any(d in blobs for n, blobs in complete.items() if n != r.node)


@given(worlds())
@settings(max_examples=60, deadline=None)
def test_nobody_waits_forever(world) -> None:  # type: ignore[no-untyped-def]
    """When requests wait, something is making progress: an origin fill runs or is
    granted (so a failed seed's slot goes to a waiting node)."""
    requests, complete, running, budget = world
    out = plan_fanout(requests, complete, running, budget)
    if any(m is Mode.WAIT for m in out.values()):
        assert _origin(out) or running


@given(worlds(), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_the_plan_does_not_depend_on_input_order(world, rnd) -> None:  # type: ignore[no-untyped-def]
    """The same world in another order gives the same plan (deterministic)."""
    requests, complete, running, budget = world
    shuffled = list(requests)
    rnd.shuffle(shuffled)
    assert plan_fanout(requests, complete, running, budget) == plan_fanout(
        shuffled, dict(reversed(list(complete.items()))), sorted(running), budget
    )


@pytest.mark.parametrize("n", [2, 6, 8, 50])
@pytest.mark.parametrize("fills", [None, 1, 3])
def test_warming_n_nodes_fetches_one_copy_per_seed_slot(n: int, fills: int | None) -> None:
    """Replaying the plan until every node is warm (each round, granted fills complete):
    without a budget the origin serves exactly one copy; with ``concurrent_fills=k`` at
    most k copies, and every node ends warm."""
    blobs = frozenset({"x", "y"})
    nodes = [f"node-{i}" for i in range(n)]
    complete: dict[str, frozenset[str]] = {m: frozenset() for m in nodes}
    origin_copies = 0
    for _ in range(n + 2):
        requests = [WarmRequest(m, "r", blobs - complete[m]) for m in nodes if complete[m] != blobs]
        if not requests:
            break
        out = plan_fanout(requests, complete, (), Budget(concurrent_fills=fills))
        origin_copies += sum(1 for m in out.values() if m is Mode.ORIGIN)
        for (m, _), mode in out.items():
            if mode is not Mode.WAIT:
                complete[m] = blobs
    assert all(v == blobs for v in complete.values())
    assert origin_copies == (1 if fills is None else min(fills, n))


def test_running_fill_keeps_its_slot_and_others_wait() -> None:
    """A running origin fill stays ``ORIGIN``; a second node waits for it (default
    budget), and goes to peers once the seed holds every blob."""
    req = [WarmRequest("a", "r", frozenset({"x"})), WarmRequest("b", "r", frozenset({"x"}))]
    none: dict[str, frozenset[str]] = {"a": frozenset(), "b": frozenset()}
    assert plan_fanout(req, none, [("a", "r")], Budget()) == {
        ("a", "r"): Mode.ORIGIN,
        ("b", "r"): Mode.WAIT,
    }
    seeded = {"a": frozenset({"x"}), "b": frozenset()}
    assert plan_fanout(req[1:], seeded, [], Budget())[("b", "r")] is Mode.PEER


def test_receivers_take_a_filling_seed_as_their_source() -> None:
    """With the seed's origin fill named in ``filling``, the other nodes go to peers at
    once instead of waiting for it to finish; a blob nobody fills still waits."""
    req = [WarmRequest(n, "r", frozenset({"x"})) for n in "abc"]
    none: dict[str, frozenset[str]] = dict.fromkeys("abc", frozenset())
    out = plan_fanout(req, none, [("a", "r")], Budget(), filling={"a": frozenset({"x"})})
    assert out == {("a", "r"): Mode.ORIGIN, ("b", "r"): Mode.PEER, ("c", "r"): Mode.PEER}
    other = [WarmRequest("b", "r", frozenset({"x", "y"}))]
    out = plan_fanout(other, none, [("a", "r")], Budget(), filling={"a": frozenset({"x"})})
    assert out == {("b", "r"): Mode.WAIT}


def test_budget_rejects_nonsense() -> None:
    """A zero fill count or bandwidth is refused with the bad value named."""
    with pytest.raises(ValueError, match="concurrent_fills 0"):
        Budget(concurrent_fills=0)
    with pytest.raises(ValueError, match="bandwidth -1"):
        Budget(bandwidth=-1)


@given(
    st.lists(
        st.builds(Candidate, st.sampled_from(NODES), st.integers(0, 5), st.booleans()), max_size=12
    ),
    st.text(min_size=1, max_size=8),
    st.frozensets(st.sampled_from(NODES)),
)
@settings(max_examples=60, deadline=None)
def test_rank_peers_prefers_idle_peers_and_skips_avoided(cands, key, avoid) -> None:  # type: ignore[no-untyped-def]
    """Ranking lists each non-avoided candidate once, least busy first, stable for a key."""
    ranked = rank_peers(cands, key, avoid)
    first = {}
    for c in cands:
        first.setdefault(c.name, c)
    assert set(ranked) == {n for n in first if n not in avoid}
    busy = [first[n].serving for n in ranked]
    assert busy == sorted(busy)
    assert rank_peers(list(reversed(list(first.values()))), key, avoid) == ranked


def test_rank_peers_spreads_pieces_over_peers() -> None:
    """With idle peers, the first choice for the pieces of one blob spreads over all of
    them (several peers serve one blob at once)."""
    peers = [Candidate(f"p{i}") for i in range(4)]
    firsts = {rank_peers(peers, f"blob:{i}")[0] for i in range(64)}
    assert firsts == {"p0", "p1", "p2", "p3"}
