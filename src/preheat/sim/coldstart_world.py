"""The simulated fleet's executor: carries out ``control.plan``'s actions.

Pure (virtual time from the shared ``sim.events.EventQueue``). This is the simulator's
counterpart of ``runtime.local_executor``; ``World`` stacks one concept per module:

- ``coldstart_fleet.FleetState``: nodes, replicas, fills and models, the ``Observed``
  views the planner sees, and the demand ledger;
- ``coldstart_fills.Fills``: ``Warm`` and every download of weights (room by
  ``plan_eviction``, peer or origin, refusals as ``unfit`` / ``failed``);
- ``coldstart_lifecycle.Lifecycle``: ``StartReplica`` (hit, wait for a running fill, or a
  fill of its own; the image), readiness, crash restarts, ``Drain`` / ``StopReplica``;
- here, ``World.execute``: each ``control.state`` action to its handler, and gates,
  routes and rollouts with the same bookkeeping as the live executor.
"""

from __future__ import annotations

import dataclasses

from preheat.control.state import (
    Action,
    AddRoute,
    DeleteRevision,
    Drain,
    FinishRollout,
    Notice,
    OpenGate,
    Rollback,
    StartReplica,
    StopReplica,
    Unschedulable,
    WaitGate,
    Warm,
)
from preheat.sim.coldstart_lifecycle import Lifecycle

__all__ = ["World"]


class World(Lifecycle):
    """The fleet and the action handlers (see the module docstring)."""

    def execute(self, a: Action) -> None:
        if isinstance(a, Warm):
            self.warm(a.node, a.revision, a.variant)
        elif isinstance(a, StartReplica):
            self.start_replica(a)
        elif isinstance(a, AddRoute):
            r = self.replicas.get(a.replica)
            if r is not None and r.phase == "ready" and not r.routed:
                r.routed = True
                self.dirty.add(r.model)  # a rollout drains an old replica per routed new one
        elif isinstance(a, Drain):
            self.drain(a.replica, a.reason)
        elif isinstance(a, StopReplica):
            self.stop(a.replica, a.reason, failed=False)
        elif isinstance(a, WaitGate):
            ms = self.models[a.variant]
            if ms.status.waiting_since(a.revision) is None:
                ms.status = dataclasses.replace(
                    ms.status, gate_since=(*ms.status.gate_since, (a.revision, self.agenda.now))
                )
                self.agenda.after(self.catalog.gate_timeout_seconds, "wake", a.variant)
        elif isinstance(a, OpenGate):
            ms = self.models[a.variant]
            ms.status = dataclasses.replace(ms.status, gate_open=ms.status.gate_open | {a.revision})
        elif isinstance(a, FinishRollout):
            ms = self.models[a.variant]
            ms.status = dataclasses.replace(ms.status, stable=a.revision)
            if a.previous is not None:  # its predecessor is no longer kept for a rollback
                self.rollouts_finished += 1
                began = self.released_at.pop(a.revision, None)
                if began is not None:
                    self.rollout_seconds[a.revision] = self.agenda.now - began
                self.dirty.add(a.variant)
        elif isinstance(a, Rollback):
            ms = self.models[a.variant]
            ms.status = dataclasses.replace(
                ms.status, failed=ms.status.failed | {a.revision}, stable=ms.status.stable or a.to
            )
        elif isinstance(a, Unschedulable):
            self.models[a.variant].unschedulable += a.missing
        elif isinstance(a, DeleteRevision):
            # A superseded revision no replica uses (the live executor's delete_revision:
            # its view goes, then the snapshot, and the room is free for held warm-ups).
            key = (a.node, a.revision)
            self.failed_views.pop(key, None)
            self.held.discard(key)
            node = self.nodes.get(a.node)
            snap = node.snaps.get(a.revision) if node else None
            if node is not None and snap is not None and not snap.leases:
                del node.snaps[a.revision]
                self.deleted.append((self.agenda.now, a.node, a.revision))
                self.space_changed(a.node)
                if snap.pinned:
                    self.pins_freed(a.node)
        elif isinstance(a, Notice) and len(self.notices) < 100:
            self.notices.append(a.text)
