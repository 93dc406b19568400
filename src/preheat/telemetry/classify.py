"""Event classes of replica starts: a pure function of what the controller knew.

Percentiles are only meaningful within one kind of start (a process restart on a node
whose page cache still holds the weights and a first start on a node that just joined
differ by orders of magnitude), so every start gets exactly one ``EventClass``.

Inputs (``StartContext``, filled in by the controller when it schedules the start):

- ``reason``: why the controller started a replica: ``initial`` (the endpoint's first
  deployment, or bringing the count back to ``min``), ``scale_out`` (manual scale or the
  autoscaler added a replica), ``restart`` (a replica process exited and its slot is
  started again), ``rollout`` (a replica of a new revision or image during a version
  change), ``node_loss`` (replacing a replica whose node failed).
- ``same_replica_on_node_before``: this replica slot ran on this very node before.
- ``node_is_new``: the node joined the cluster (``preheat node add``) while the endpoint
  ran, after its first replica became healthy or while the first replicas were still
  starting, and has not hosted a replica of the endpoint yet. Nodes listed in the
  cluster file are never new: they were there when the deployment was planned.
- ``node_had_revision``: the node's store held the revision's snapshot when the start was
  scheduled (the weights-source label records what actually happened; this is what the
  controller expected).

Precedence (first match wins):

1. ``warm_restart``       reason ``restart`` and the same replica ran on this node before.
                          A crash-restart elsewhere falls through to the rules below.
2. ``node_loss_recovery`` reason ``node_loss``: its tail is what an outage costs,
                          whatever the replacement node held.
3. ``new_version``        reason ``rollout``: a start of a revision or image the endpoint
                          was not serving.
4. ``new_node``           the node is new (``node_is_new``), whatever the reason
                          (``initial`` after a ``node add``, or ``scale_out``): the first
                          start on a node is the tail an operator adds nodes for.
5. ``scale_out``          reason ``scale_out`` on a node that is not new.
6. ``cold_pod_warm_node`` a fresh replica (``initial``, or a restart on another node) on a
                          node that held the revision.
7. ``new_node``           the same on a node that did not hold it (cold fallback
                          placement): the node is new to this revision.

Cache state is never folded into the class beyond rules 6/7; the ``weights_source`` and
``image_source`` labels on each record carry it, so "scale-out on a warm node" and
"scale-out on a cold node" are both ``scale_out`` with different labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from preheat.telemetry.records import EventClass

__all__ = ["EventClass", "StartContext", "StartReason", "classify_start"]


class StartReason(StrEnum):
    """Why the controller started a replica."""

    INITIAL = "initial"
    SCALE_OUT = "scale_out"
    RESTART = "restart"
    ROLLOUT = "rollout"
    NODE_LOSS = "node_loss"


@dataclass(frozen=True, slots=True)
class StartContext:
    """What the controller knew when it scheduled a start (see the module header)."""

    reason: StartReason
    node_had_revision: bool = False
    node_is_new: bool = False
    same_replica_on_node_before: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.reason, StartReason):
            try:
                object.__setattr__(self, "reason", StartReason(self.reason))
            except ValueError:
                raise ValueError(
                    f"StartContext.reason = {self.reason!r}; "
                    f"use one of {', '.join(r.value for r in StartReason)}"
                ) from None


def classify_start(ctx: StartContext) -> EventClass:
    """The event class of a start; precedence as in the module header."""
    if ctx.reason is StartReason.RESTART and ctx.same_replica_on_node_before:
        return EventClass.WARM_RESTART
    if ctx.reason is StartReason.NODE_LOSS:
        return EventClass.NODE_LOSS_RECOVERY
    if ctx.reason is StartReason.ROLLOUT:
        return EventClass.NEW_VERSION
    if ctx.node_is_new:
        return EventClass.NEW_NODE
    if ctx.reason is StartReason.SCALE_OUT:
        return EventClass.SCALE_OUT
    if ctx.node_had_revision:
        return EventClass.COLD_POD_WARM_NODE
    return EventClass.NEW_NODE
