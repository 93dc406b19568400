"""The planner's clean-up during a rollout: a superseded revision is kept for a rollback,
except where it holds the room its own variant's new revision needs."""

from __future__ import annotations

from preheat.control.plan import plan
from preheat.control.state import (
    CacheView,
    DeleteRevision,
    Desired,
    DesiredVariant,
    NodeView,
    Observed,
    OpenGate,
    ReplicaView,
    VariantStatus,
    WaitGate,
    WeightsPolicy,
)

OLD = "sha256-1111111111111111"
NEW = "sha256-2222222222222222"
OTHER = "sha256-3333333333333333"

#: Room held by other copies (a pinned old one): the reporter looks again at ``retry_at``.
NO_ROOM = CacheView(
    "unfit", reason="100 GB needed, 50 GB free, 100 GB pinned", retry_at=60.0, short_of_room=True
)
#: Room held by a warmed copy no replica used (warm-ups spare it): retried with backoff.
DEFERRED = CacheView(
    "failed", reason="1 warmed copy no replica used", retry_at=60.0, short_of_room=True
)
#: The disk itself is too small: nothing frees it.
TOO_SMALL = CacheView("unfit", reason="bigger than the disk", retry_at=0.0)


def _desired(*variants: tuple[str, str]) -> Desired:
    return Desired(
        endpoint="chat",
        variants=tuple(DesiredVariant(name, rev, 100, 1) for name, rev in variants),
        weights=WeightsPolicy(enabled=True, pin=True, timeout_seconds=600),
    )


def _node(name: str, *cache: tuple[str, CacheView]) -> NodeView:
    return NodeView(name, slots=2, cache=cache)


def _rolling(*nodes: NodeView, serving_on: str = "a") -> Observed:
    """``main`` rolls from OLD (stable, one replica on ``serving_on``) to NEW."""
    st = VariantStatus(stable=OLD, gate_open=frozenset({OLD}))
    reps = (ReplicaView("r1", "main", OLD, serving_on, "ready", routed=True, seq=1),)
    return Observed(now=10, nodes=nodes, replicas=reps, variants=(("main", st),))


def _deletes(desired: Desired, observed: Observed) -> list[DeleteRevision]:
    return [a for a in plan(desired, observed) if isinstance(a, DeleteRevision)]


def test_an_unused_superseded_copy_yields_to_the_new_revision_that_lacks_room() -> None:
    """Mid-rollout, the old copy stays where the new revision fits (rollback needs it) and
    where a replica still serves it; on a node where the new revision is ``unfit`` for
    want of room and no replica uses the old copy, the old copy is deleted. The old
    planner kept it everywhere until the rollout finished, which a pinned copy on a
    tight disk never let happen."""
    obs = _rolling(
        _node("a", (OLD, CacheView("ready")), (NEW, NO_ROOM)),  # serves OLD: kept
        _node("b", (OLD, CacheView("ready")), (NEW, NO_ROOM)),  # idle copy: yields
        _node("c", (OLD, CacheView("ready")), (NEW, CacheView("ready"))),  # fits: kept
        _node("d", (OLD, CacheView("ready")), (NEW, CacheView("warming"))),  # kept
        _node("e", (OLD, CacheView("ready")), (NEW, DEFERRED)),  # spared copy: yields
    )
    assert _deletes(_desired(("main", NEW)), obs) == [
        DeleteRevision("b", OLD),
        DeleteRevision("e", OLD),
    ]


def test_the_gate_does_not_wait_for_a_node_short_of_room() -> None:
    """A node whose warm-up of the new revision is short of room while it still serves
    the old one (whose lease holds the room) is not waited for: the rollout the gate
    would hold up is what frees it. The old gate counted a ``failed`` one and waited for
    its timeout."""
    leased = CacheView("failed", reason="the rest is leased", retry_at=60.0, short_of_room=True)
    obs = _rolling(
        _node("a", (OLD, CacheView("ready")), (NEW, leased)),
        _node("b", (NEW, CacheView("ready"))),
    )
    opened = [a for a in plan(_desired(("main", NEW)), obs) if isinstance(a, OpenGate)]
    assert opened == [OpenGate("main", NEW, 1, 1)]


def test_the_gate_waits_for_an_idle_node_short_of_room() -> None:
    """A node short of room where no replica of the variant runs is waited for (its old
    copy is deleted in the same pass, and it warms next), so a fleet short of room
    everywhere does not open the gate at 0 of 0 and start cold."""
    obs = _rolling(
        _node("a", (OLD, CacheView("ready")), (NEW, NO_ROOM)),  # serves OLD: left out
        _node("b", (OLD, CacheView("ready")), (NEW, NO_ROOM)),  # idle: waited for
    )
    acts = plan(_desired(("main", NEW)), obs)
    waits = [a for a in acts if isinstance(a, WaitGate)]
    assert [(w.ready, w.needed, w.waiting_on) for w in waits] == [(0, 1, ("b",))]
    assert not [a for a in acts if isinstance(a, OpenGate)]
    assert [a for a in acts if isinstance(a, DeleteRevision)] == [DeleteRevision("b", OLD)]


def test_a_new_revision_the_disk_can_never_hold_keeps_the_old_copy() -> None:
    """``unfit`` for good (``retry_at`` 0): deleting the old copy would not make room, so
    the rollback copy is kept."""
    obs = _rolling(
        _node("a", (OLD, CacheView("ready"))),
        _node("b", (OLD, CacheView("ready")), (NEW, TOO_SMALL)),
    )
    assert _deletes(_desired(("main", NEW)), obs) == []


def test_a_revision_another_variant_runs_does_not_yield() -> None:
    """The superseded revision of one variant that another variant still wants as its own
    is not deleted for the first one's rollout."""
    obs = _rolling(
        _node("a", (OLD, CacheView("ready"))),
        _node("b", (OLD, CacheView("ready")), (NEW, NO_ROOM)),
    )
    assert _deletes(_desired(("main", NEW), ("canary", OLD)), obs) == []


def test_no_rollout_no_yield() -> None:
    """Without a rollout (the stable revision is the wanted one) nothing is superseded:
    an ``unfit`` other revision does not make the planner delete the wanted copy (nor
    itself: only ``ready`` and ``failed`` copies are deleted)."""
    st = VariantStatus(stable=OLD, gate_open=frozenset({OLD}))
    obs = Observed(
        now=10,
        nodes=(_node("b", (OLD, CacheView("ready")), (OTHER, NO_ROOM)),),
        variants=(("main", st),),
    )
    assert _deletes(_desired(("main", OLD)), obs) == []
