"""The planner with a revocation list: fallback rollouts, holds, clean-up."""

from __future__ import annotations

import dataclasses

from preheat.control.plan import plan
from preheat.control.state import (
    CacheView,
    DeleteRevision,
    Desired,
    DesiredVariant,
    NodeView,
    Observed,
    ReplicaView,
    Revoked,
    Rollback,
    StartReplica,
    VariantStatus,
    WaitGate,
    Warm,
    WeightsPolicy,
)

R1 = "sha256-1111111111111111"
R2 = "sha256-2222222222222222"
R3 = "sha256-3333333333333333"


def desired(*fallbacks: str, replicas: int = 2) -> Desired:
    return Desired(
        endpoint="chat",
        variants=(
            DesiredVariant(
                "main", R1, 1000, replicas, fallbacks=tuple((f, 900) for f in fallbacks)
            ),
        ),
        weights=WeightsPolicy(enabled=True, timeout_seconds=60),
    )


def node(name: str, *ready: str) -> NodeView:
    return NodeView(name, slots=2, cache=tuple((r, CacheView("ready")) for r in ready))


def serving(*nodes: str, rev: str = R1) -> tuple[ReplicaView, ...]:
    return tuple(
        ReplicaView(f"r{i}", "main", rev, n, "ready", routed=True, seq=i)
        for i, n in enumerate(nodes)
    )


def of(actions: tuple[object, ...], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def steady(revoked: frozenset[str], *, stable: str = R1) -> Observed:
    return Observed(
        now=10,
        nodes=(node("a", R1), node("b", R1)),
        replicas=serving("a", "b"),
        variants=(("main", VariantStatus(stable=stable, gate_open=frozenset({R1}))),),
        revoked=revoked,
    )


def test_no_revocation_changes_nothing() -> None:
    """An empty list plans exactly what the planner planned before revocations existed."""
    obs = steady(frozenset())
    assert plan(desired(R2), obs) == plan(desired(), obs)
    assert of(plan(desired(R2), obs), Revoked) == []


def test_revoked_revision_rolls_to_first_allowed_fallback() -> None:
    """A revoked current revision warms the first fallback that is not revoked, gates on it,
    and neither warms nor keeps the revoked one."""
    acts = plan(desired(R2, R3), steady(frozenset({R1, R2})))
    (r,) = of(acts, Revoked)
    assert (r.variant, r.revision, r.to) == ("main", R1, R3)
    assert "rolling to fallback" in r.message
    assert sorted((w.node, w.revision) for w in of(acts, Warm)) == [("a", R3), ("b", R3)]
    assert {g.revision for g in of(acts, WaitGate)} == {R3}
    assert of(acts, StartReplica) == []  # the gate holds until the fallback is warm


def test_fallback_rollout_starts_once_warm_and_old_cache_goes_when_unused() -> None:
    """Once the fallback is warm its replicas surge in; the revoked revision is deleted from
    a node as soon as no replica holds it (not kept as a rollback target)."""
    obs = dataclasses.replace(
        steady(frozenset({R1})),
        nodes=(node("a", R1, R2), node("b", R1, R2), node("c", R1, R2)),
        replicas=serving("a", "b"),
    )
    acts = plan(desired(R2), obs)
    starts = of(acts, StartReplica)
    assert starts and {s.revision for s in starts} == {R2}
    # Node c holds R1 but runs nothing: deleted now. a and b keep it while replicas use it.
    assert [(d.node, d.revision) for d in of(acts, DeleteRevision)] == [("c", R1)]


def test_revoked_without_fallback_holds_and_reports() -> None:
    """No allowed fallback: the variant is reported, no replica starts (not even to replace
    a lost one), and serving replicas are not stopped."""
    obs = dataclasses.replace(steady(frozenset({R1})), replicas=serving("a"))
    acts = plan(desired(R2), dataclasses.replace(obs, revoked=frozenset({R1, R2})))
    (r,) = of(acts, Revoked)
    assert r.to is None and "no other revision" in r.message
    assert of(acts, StartReplica) == []
    assert of(acts, Warm) == []
    assert [a for a in acts if type(a).__name__ in ("StopReplica", "Drain")] == []


def test_revoked_stable_is_no_rollback_target() -> None:
    """A rollout from a revoked stable revision whose replica fails is not rolled back to it."""
    obs = Observed(
        now=10,
        nodes=(node("a", R1, R2), node("b", R1, R2)),
        replicas=(
            *serving("a", rev=R1),
            ReplicaView("n1", "main", R2, "b", "failed", seq=5),
        ),
        variants=(("main", VariantStatus(stable=R1, gate_open=frozenset({R1, R2}))),),
        revoked=frozenset({R1}),
    )
    d = dataclasses.replace(
        desired(), variants=(dataclasses.replace(desired().variants[0], revision=R2),)
    )
    assert of(plan(d, obs), Rollback) == []
    assert of(plan(d, dataclasses.replace(obs, revoked=frozenset())), Rollback) != []
