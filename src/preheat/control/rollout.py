"""Replica steps for one variant: scale in steady state, roll to a new revision, roll back.

A variant has a *target* version (the spec's model revision, resolved, plus a fingerprint
of its engine and image: ``state.version_of``) and a *stable* one (the last that finished
rolling out). A new revision, a new image or a new engine command each roll the replicas;
only a new revision moves weights. The version the replicas converge on is::

    effective = stable   if target failed its rollout and a stable one exists
              = target   otherwise

Rolling update (surge first, never below the desired count of serving replicas):

1. The new revision is warmed on the target nodes and must pass the cache gate
   (``plan.py``) before any new replica is created.
2. While old-revision replicas exist, start new ones as long as the live total stays
   within ``desired + max_surge`` and there are fewer than ``desired`` new ones.
3. A new replica counts as available only once it is healthy *and* in the router. Then
   old replicas are drained, one per available new replica above ``desired``: the router
   stops sending them requests first, the process stops after its in-flight requests
   finish. Old replicas that never became ready are stopped at once.
   When no node has a free slot for the surge replica, one old replica is drained first
   to make room (at most one unavailable, never the last one serving; a node that
   already holds the new revision is preferred, so its successor starts warm). With a
   single replica and no free slot the rollout waits and says why.
4. When no old replica is left and ``desired`` new ones are ready, the rollout finishes:
   the new revision becomes stable; its predecessor is no longer used by any replica, so
   its leases are gone and ``plan.py`` deletes its cache from every node.

Rollback: a new-revision replica that fails for good (its restart budget spent, or never
healthy in time) while a stable revision exists marks the target failed. The effective
revision goes back to stable, so the new replicas become the "old" ones and are drained,
while the stable replicas were never taken below ``desired`` and keep serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from preheat.control.placement import choose_victims, place
from preheat.control.state import (
    Action,
    AddRoute,
    DesiredVariant,
    Drain,
    FinishRollout,
    NodeView,
    ReplicaView,
    Rollback,
    StartReason,
    StartReplica,
    StopReplica,
    Unschedulable,
    VariantStatus,
    revision_of,
)

__all__ = ["effective_version", "rollback_needed", "step_variant"]


def effective_version(target: str, status: VariantStatus) -> str:
    """The version replicas converge on (see the module docstring)."""
    if target in status.failed and status.stable is not None:
        return status.stable
    return target


def rollback_needed(
    dv: DesiredVariant, status: VariantStatus, replicas: Sequence[ReplicaView]
) -> Rollback | None:
    """A rollout of ``dv.version`` must be abandoned: one of its replicas failed for good.

    The version to go back to is the stable one; before the first rollout was recorded
    as finished, it is the one version all other ready replicas run (if they agree)."""
    stable = status.stable
    if stable is None:
        others = {
            r.version
            for r in replicas
            if r.variant == dv.name and r.version != dv.version and r.phase == "ready"
        }
        stable = others.pop() if len(others) == 1 else None
    if stable is None or stable == dv.version or dv.version in status.failed:
        return None
    for r in replicas:
        if r.variant == dv.name and r.version == dv.version and r.phase == "failed":
            return Rollback(
                variant=dv.name,
                revision=dv.version,
                to=stable,
                reason=f"replica {r.id} on {r.node} failed while rolling out {dv.version[:20]}",
            )
    return None


def step_variant(
    dv: DesiredVariant,
    status: VariantStatus,
    replicas: Sequence[ReplicaView],
    nodes: Sequence[NodeView],
    *,
    may_start: bool,
    max_surge: int = 1,
    planned: dict[str, int] | None = None,
) -> list[Action]:
    """Actions that move this variant's replicas one step towards the desired state.

    ``replicas`` is every replica (all variants: placement needs the slot counts);
    ``may_start`` is False while the cache gate holds back new replicas; ``planned``
    is updated with the placements made here.
    """
    target = effective_version(dv.version, status)
    target_rev = revision_of(target)
    template = target[len(target_rev) + 1 :]
    mine = [r for r in replicas if r.variant == dv.name]
    live = [r for r in mine if r.phase in ("starting", "ready")]
    new = [r for r in live if r.version == target]
    old = [r for r in live if r.version != target]
    out: list[Action] = []

    # Failed replicas (restart budget spent): clean up; steady state replaces them below.
    for r in mine:
        if r.phase == "failed":
            out.append(StopReplica(r.id, reason="failed"))

    # Ready, live replicas belong in the router, whatever their revision (old ones serve
    # until drained).
    for r in live:
        if r.phase == "ready" and not r.routed:
            out.append(AddRoute(r.id))

    def start(n: int, reason: StartReason) -> int:
        """Place up to ``n`` new replicas; returns how many could not be placed."""
        if n <= 0 or not may_start:
            return 0
        placements, why = place(
            nodes, replicas, variant=dv.name, revision=target_rev, count=n, planned=planned
        )
        for p in placements:
            out.append(
                StartReplica(
                    dv.name, target_rev, p.node, warm=p.warm, reason=reason, template=template
                )
            )
            if planned is not None:
                planned[p.node] = planned.get(p.node, 0) + 1
        if why:
            out.append(Unschedulable(dv.name, target_rev, n - len(placements), why))
        return n - len(placements)

    if not old:
        missing = dv.replicas - len(new)
        if missing > 0:
            failed_before = sum(1 for r in mine if r.phase == "failed" and r.version == target)
            if status.stable is None and not any(r.version == target for r in mine):
                start(missing, "initial")
            elif failed_before:
                start(missing, "replace")
            else:
                start(missing, "scale_out")
        elif missing < 0:
            for r in choose_victims(new, nodes, -missing):
                out.append(Drain(r.id, reason="scale in"))
        elif status.stable != target and all(r.phase == "ready" and r.routed for r in new):
            out.append(FinishRollout(dv.name, target, previous=status.stable))
        return out

    # Rolling: old replicas that never served are simply stopped.
    for r in old:
        if r.phase != "ready":
            out.append(Drain(r.id, reason="superseded before it was ready"))
    old_ready = [r for r in old if r.phase == "ready"]
    room = dv.replicas + max_surge - len(new) - len(old_ready)
    wanted = min(dv.replicas - len(new), room)
    unplaced = start(wanted, "rollout")
    available_new = [r for r in new if r.phase == "ready" and r.routed]
    excess = len(available_new) + len(old_ready) - dv.replicas
    if excess > 0:
        for r in sorted(old_ready, key=lambda r: r.seq)[:excess]:
            out.append(Drain(r.id, reason=f"replaced by {target[:20]}"))
    elif (
        unplaced
        and unplaced == wanted  # nothing could start this tick
        and len(available_new) == len(new)  # no new replica still on its way in
        and not any(r.phase == "draining" for r in mine)
        and len(available_new) + len(old_ready) >= 2
    ):
        # No free slot for the surge replica: make room by draining one old replica
        # (at most one unavailable at a time, never the last one serving), preferring
        # one on a node that already holds the new revision so its successor starts warm.
        warm_nodes = {n.name for n in nodes if n.holds(target_rev)}
        victim = min(old_ready, key=lambda r: (r.node not in warm_nodes, r.seq))
        out.append(Drain(victim.id, reason=f"making room for {target[:20]} (no free slot)"))
    return out


def replicas_using(replicas: Sequence[ReplicaView]) -> Mapping[tuple[str, str], int]:
    """(node, revision) -> replicas that hold a lease on it (not stopped)."""
    out: dict[tuple[str, str], int] = {}
    for r in replicas:
        if r.phase != "stopped":
            out[(r.node, r.revision)] = out.get((r.node, r.revision), 0) + 1
    return out
