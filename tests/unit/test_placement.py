"""Placement prefers nodes that hold the revision and never requires it."""

from __future__ import annotations

from preheat.control.placement import choose_victims, place
from preheat.control.state import CacheView, NodeView, ReplicaView

REV = "sha256-aaaaaaaaaaaaaaaa"


def node(name: str, state: str = "absent", *, slots: int = 2, up: bool = True) -> NodeView:
    cache = () if state == "absent" else ((REV, CacheView(state, reason="1.0 GiB > 0.5 GiB")),)  # type: ignore[arg-type]
    return NodeView(name=name, up=up, slots=slots, cache=cache)


def rep(i: int, node: str, *, phase: str = "ready", variant: str = "main") -> ReplicaView:
    return ReplicaView(f"r{i}", variant, REV, node, phase, routed=True, seq=i)  # type: ignore[arg-type]


def test_ready_before_warming_before_cold() -> None:
    """A node holding the revision wins, a warming one comes next, a cold one last."""
    nodes = [node("a"), node("b", "warming"), node("c", "ready")]
    got, why = place(nodes, [], variant="main", revision=REV, count=1)
    assert [(p.node, p.warm) for p in got] == [("c", True)] and why == ""
    got, _ = place(nodes[:2], [], variant="main", revision=REV, count=1)
    assert [(p.node, p.warm) for p in got] == [("b", False)]


def test_cold_fallback_when_warm_nodes_are_full() -> None:
    """Warm nodes fill first; the rest go to cold nodes instead of waiting."""
    nodes = [node("a", "ready", slots=1), node("b", "ready", slots=1), node("c", slots=1)]
    got, why = place(nodes, [], variant="main", revision=REV, count=3)
    assert [(p.node, p.warm) for p in got] == [("a", True), ("b", True), ("c", False)]
    assert why == ""


def test_spread_across_equal_nodes() -> None:
    """Among equally warm nodes a variant spreads out rather than stacking."""
    nodes = [node("a", "ready"), node("b", "ready")]
    got, _ = place(nodes, [rep(1, "a")], variant="main", revision=REV, count=2)
    assert [p.node for p in got] == ["b", "a"]


def test_excluded_nodes_and_reason() -> None:
    """Down, full and unfit nodes are never chosen; the shortfall says why with numbers."""
    nodes = [
        node("a", "ready", up=False),
        node("b", "unfit"),
        node("c", slots=1),
    ]
    got, why = place(nodes, [rep(1, "c")], variant="main", revision=REV, count=1)
    assert got == []
    assert "b (1.0 GiB > 0.5 GiB)" in why and "down: a" in why and "preheat node add" in why


def test_planned_counts_reserve_slots() -> None:
    """Placements already made in the same plan take their slots."""
    got, why = place(
        [node("a", "ready", slots=1)], [], variant="x", revision=REV, count=1, planned={"a": 1}
    )
    assert got == [] and why


def test_victims_not_ready_then_cold_then_loaded_newest() -> None:
    """Scale-in removes a starting replica first, then cold-node ones, then the newest."""
    nodes = [node("a", "ready"), node("b")]
    reps = [rep(1, "a"), rep(2, "a"), rep(3, "b"), rep(4, "a", phase="starting")]
    order = [r.id for r in choose_victims(reps, nodes, 4)]
    assert order == ["r4", "r3", "r2", "r1"]
    assert choose_victims(reps, nodes, 0) == []
