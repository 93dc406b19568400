"""The pure planner: warm-up, the minReady gate, lost nodes, routing and clean-up."""

from __future__ import annotations

from preheat.control.fanout import Budget
from preheat.control.plan import plan
from preheat.control.state import (
    AddRoute,
    CacheView,
    DeleteRevision,
    Desired,
    DesiredVariant,
    Drain,
    NodeView,
    Notice,
    Observed,
    OpenGate,
    ReplicaView,
    StartReplica,
    StopReplica,
    Unschedulable,
    VariantStatus,
    WaitGate,
    Warm,
    WeightsPolicy,
)

R1 = "sha256-1111111111111111"
R2 = "sha256-2222222222222222"


def desired(replicas: int = 2, *, rev: str = R1, min_ready: int | None = None) -> Desired:
    return Desired(
        endpoint="chat",
        variants=(DesiredVariant("main", rev, 1000, replicas),),
        weights=WeightsPolicy(enabled=True, min_ready=min_ready, timeout_seconds=60),
    )


def node(name: str, *cache: tuple[str, str], up: bool = True, target: bool = True) -> NodeView:
    return NodeView(
        name,
        up=up,
        slots=2,
        target=target,
        cache=tuple((rev, CacheView(state, reason="why", retry_at=50)) for rev, state in cache),  # type: ignore[arg-type]
    )


def of(actions: tuple[object, ...], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def test_warm_targets_and_hold_replicas_until_min_ready() -> None:
    """Every target node is warmed; no replica starts before the gate opens."""
    obs = Observed(now=0, nodes=(node("a"), node("b"), node("c", target=False)))
    acts = plan(desired(), obs)
    assert [(w.node, w.revision) for w in of(acts, Warm)] == [("a", R1), ("b", R1)]
    (g,) = of(acts, WaitGate)
    assert (g.ready, g.needed, g.waiting_on) == (0, 2, ("a", "b"))
    assert of(acts, StartReplica) == []


def test_gate_opens_at_min_ready_and_prefers_warm_nodes() -> None:
    """With minReady=1 and one node ready, the gate opens and replicas go warm-first."""
    obs = Observed(now=0, nodes=(node("a", (R1, "warming")), node("b", (R1, "ready"))))
    acts = plan(desired(min_ready=1), obs)
    assert of(acts, OpenGate) == [OpenGate("main", R1, 1, 1)]
    starts = of(acts, StartReplica)
    assert [(s.node, s.warm, s.reason) for s in starts] == [
        ("b", True, "initial"),
        ("b", True, "initial"),
    ]
    assert of(acts, Warm) == []  # a is already warming, b is ready


def test_gate_timeout_deploys_anyway_and_says_so() -> None:
    """After timeoutSeconds of waiting the gate opens with a notice; cold nodes take replicas."""
    st = VariantStatus(gate_since=((R1, 0.0),))
    obs = Observed(now=61, nodes=(node("a", (R1, "warming")), node("b")), variants=(("main", st),))
    acts = plan(desired(), obs)
    (g,) = of(acts, OpenGate)
    assert g.timed_out and g.ready == 0
    assert "deploying anyway" in of(acts, Notice)[0].text
    assert len(of(acts, StartReplica)) == 2


def test_gate_is_latched() -> None:
    """Once open for a revision, losing warm nodes does not hold back replacements."""
    st = VariantStatus(stable=R1, gate_open=frozenset({R1}))
    obs = Observed(now=0, nodes=(node("a"), node("b")), variants=(("main", st),))
    acts = plan(desired(), obs)
    assert of(acts, WaitGate) == [] and len(of(acts, StartReplica)) == 2


def test_unfit_node_is_left_out_and_others_proceed() -> None:
    """A node too small for the model does not block the default gate, gets no replica."""
    obs = Observed(now=0, nodes=(node("a", (R1, "ready")), node("small", (R1, "unfit"))))
    acts = plan(desired(replicas=3), obs)
    (g,) = of(acts, OpenGate)
    assert (g.ready, g.needed) == (1, 1)
    assert [s.node for s in of(acts, StartReplica)] == ["a", "a"]
    (u,) = of(acts, Unschedulable)
    assert u.missing == 1 and "small (why)" in u.reason


def test_failed_warm_retried_after_backoff() -> None:
    """A failed warm-up (origin unreachable) is retried only once retry_at has passed."""
    nodes = (node("a", (R1, "failed")),)
    assert of(plan(desired(replicas=1), Observed(now=10, nodes=nodes)), Warm) == []
    assert len(of(plan(desired(replicas=1), Observed(now=50, nodes=nodes)), Warm)) == 1
    waits = of(plan(desired(replicas=1), Observed(now=10, nodes=nodes)), WaitGate)
    assert waits and waits[0].waiting_on == ("a",)


def test_cache_disabled_means_no_warm_no_gate() -> None:
    """Without modelCacheConfig.weights replicas start at once, on cold nodes if need be."""
    d = Desired("chat", (DesiredVariant("main", R1, 1000, 1),))
    acts = plan(d, Observed(now=0, nodes=(node("a"),)))
    assert of(acts, Warm) == [] and of(acts, WaitGate) == []
    assert [(s.node, s.warm) for s in of(acts, StartReplica)] == [("a", False)]


def test_lost_node_replicas_stopped_and_replaced() -> None:
    """Replicas of a down node are stopped and replaced on a live node."""
    st = VariantStatus(stable=R1, gate_open=frozenset({R1}))
    reps = (
        ReplicaView("r1", "main", R1, "a", "ready", routed=True, seq=1),
        ReplicaView("r2", "main", R1, "b", "ready", routed=True, seq=2),
    )
    obs = Observed(
        now=0,
        nodes=(node("a", (R1, "ready"), up=False), node("b", (R1, "ready")), node("c")),
        replicas=reps,
        variants=(("main", st),),
    )
    acts = plan(desired(), obs)
    assert of(acts, StopReplica) == [StopReplica("r1", "node a is down")]
    (s,) = of(acts, StartReplica)
    assert s.node == "b" and s.warm  # b holds the revision and has a free slot
    assert len(of(acts, Warm)) == 1 and of(acts, Warm)[0].node == "c"  # c is a new target


def test_ready_replicas_are_routed_and_scale_in_drains() -> None:
    """A ready replica not yet in the router is added; surplus replicas are drained."""
    st = VariantStatus(stable=R1, gate_open=frozenset({R1}))
    reps = (
        ReplicaView("r1", "main", R1, "a", "ready", routed=True, seq=1),
        ReplicaView("r2", "main", R1, "a", "ready", routed=False, seq=2),
    )
    obs = Observed(
        now=0, nodes=(node("a", (R1, "ready")),), replicas=reps, variants=(("main", st),)
    )
    acts = plan(desired(replicas=2), obs)
    assert of(acts, AddRoute) == [AddRoute("r2")]
    acts = plan(desired(replicas=1), obs)
    assert of(acts, Drain) == [Drain("r2", "scale in")]


def test_unused_revision_deleted_stable_and_used_kept() -> None:
    """Only revisions no variant wants and no replica uses are deleted."""
    st = VariantStatus(stable=R1, gate_open=frozenset({R1}))
    old = "sha256-0000000000000000"
    reps = (ReplicaView("r1", "main", R1, "a", "ready", routed=True, seq=1),)
    obs = Observed(
        now=0,
        nodes=(node("a", (R1, "ready"), (old, "ready")), node("b", (old, "failed"))),
        replicas=reps,
        variants=(("main", st),),
    )
    acts = plan(desired(replicas=1), obs)
    assert of(acts, DeleteRevision) == [DeleteRevision("a", old), DeleteRevision("b", old)]


def test_warm_ups_are_staggered_under_an_origin_budget() -> None:
    """With an origin budget, plan asks only as many origin warm-ups as it allows (a node
    already warming holds a slot); once a node holds the revision the rest warm from it."""
    cold = tuple(node(n) for n in "abcd")
    assert len(of(plan(desired(), Observed(now=0, nodes=cold)), Warm)) == 4  # no budget
    two = Budget(concurrent_fills=2)
    assert [w.node for w in of(plan(desired(), Observed(now=0, nodes=cold), budget=two), Warm)] == [
        "a",
        "b",
    ]
    one_warming = (node("a", (R1, "warming")), *cold[1:])
    warms = of(plan(desired(), Observed(now=0, nodes=one_warming), budget=two), Warm)
    assert [w.node for w in warms] == ["b"]
    seeded = (node("a", (R1, "ready")), *cold[1:])
    warms = of(plan(desired(), Observed(now=0, nodes=seeded), budget=Budget(1)), Warm)
    assert [w.node for w in warms] == ["b", "c", "d"]  # from the peer, no origin slot


def test_unfit_is_re_evaluated_once_its_retry_time_has_come() -> None:
    """An ``unfit`` view with a re-check time (space freed on the node) is warmed again
    then; one without (``retry_at`` 0: nothing changed) stays left out."""
    stuck = (node("a", (R1, "ready")), NodeView("small", cache=((R1, CacheView("unfit")),)))
    assert of(plan(desired(replicas=1), Observed(now=100, nodes=stuck)), Warm) == []
    freed = NodeView("small", cache=((R1, CacheView("unfit", reason="why", retry_at=50.0)),))
    obs = Observed(now=40, nodes=(stuck[0], freed))
    assert of(plan(desired(replicas=1), obs), Warm) == []
    obs = Observed(now=50, nodes=(stuck[0], freed))
    assert [w.node for w in of(plan(desired(replicas=1), obs), Warm)] == ["small"]
