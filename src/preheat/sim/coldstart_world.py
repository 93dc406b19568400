"""The simulated fleet and the executor that carries out ``control.plan``'s actions.

Pure (virtual time from the shared ``sim.events.EventQueue``). This is the simulator's
counterpart of
``runtime.local_executor``: it owns nodes (``NodeDisk``), replicas, fills and the
network, builds ``Observed`` for the planner, and carries out each ``control.state``
action the way the live executor does:

- ``Warm``: reserve room (``plan_eviction`` decides what goes), then download from a
  peer that holds the revision (``--peers on``) or the origin; a refusal is ``unfit``
  when the disk can never hold the model and ``failed`` (retried) when leases hold it.
- ``StartReplica``: classify the start (``telemetry.classify``), then weights from the
  node's store (hit), from a fill already running there (the replica waits for it, a
  miss as in ``warmup.pull_for_replica``), or a fill of its own (a miss). Then the
  runtime starts, loads the weights from NVMe, warms up and answers its first request
  (prefill time from the model's ``timing`` profile); readiness is scheduled -> healthy.
  The runtime also needs the model's image (``coldstart_images``): from the node's image
  store or a registry pull, at the same time as the weights or before them
  (``startup.image_pull``); it starts once both are there.
- A crash (``crash``): a ready replica's engine exits and the supervisor restarts it in
  place (``warm_restart``): image and weights are on the node and the weights still in
  the page cache, so it costs the supervisor's backoff, ``startup.restart_seconds``,
  the read at ``startup.page_cache_bandwidth`` and the warm-up.
- ``Drain`` / ``StopReplica``: out of service; a drained replica stops after
  ``drain_seconds``; leases are released (the snapshot's last use is then).
- gates, routes and rollouts: the same bookkeeping as the live executor.

With cache policy ``none`` there is no store: a replica downloads into scratch space
that goes with it, so every start is a miss.
"""

from __future__ import annotations

import dataclasses

from preheat.control.state import (
    Action,
    AddRoute,
    CacheView,
    DeleteRevision,
    Drain,
    FinishRollout,
    NodeView,
    Notice,
    OpenGate,
    ReplicaView,
    Rollback,
    StartReplica,
    StopReplica,
    Unschedulable,
    WaitGate,
    Warm,
)
from preheat.sim.coldstart_config import Catalog, ModelSpec
from preheat.sim.coldstart_flows import ORIGIN, Network
from preheat.sim.coldstart_images import Images
from preheat.sim.coldstart_replicas import Fill, ModelState, SimReplica, start_record
from preheat.sim.coldstart_store import Eviction, NodeDisk, Refusal
from preheat.sim.events import EventQueue
from preheat.telemetry.classify import StartContext, StartReason, classify_start
from preheat.telemetry.records import StartRecord
from preheat.timing import get_profile

__all__ = ["World"]


class World:
    """Nodes, replicas, fills and the action handlers (see the module docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        agenda: EventQueue,
        network: Network,
        *,
        store: bool,
        peers: bool,
        priorities: bool,
    ) -> None:
        self.catalog = catalog
        self.agenda = agenda
        self.net = network
        self.store = store
        self.peers = peers
        self.priorities = priorities
        self.nodes: dict[str, NodeDisk] = {}
        self.replicas: dict[str, SimReplica] = {}
        self.fills: dict[tuple[str, str], Fill] = {}
        self.by_transfer: dict[int, Fill] = {}
        self.failed_views: dict[tuple[str, str], CacheView] = {}
        self.models: dict[str, ModelState] = {}
        self.pins: dict[str, bool] = {}
        self.records: list[StartRecord] = []
        self.evictions: list[Eviction] = []
        self.warmups = 0
        self.restarts = 0
        self.images = Images(network)
        self.notices: list[str] = []
        self.dirty: set[str] = set()
        self._seq = 0
        self._first_response = {
            m.name: get_profile(m.profile).prefill_time(catalog.startup.first_prompt_tokens)
            for m in catalog.models
        }

    # --- views for the planner ----------------------------------------------------------

    def view(self, node: NodeDisk, revision: str) -> CacheView | None:
        if node.holds(revision):
            return CacheView("ready")
        if (node.name, revision) in self.fills:
            return CacheView("warming")
        return self.failed_views.get((node.name, revision))

    def node_views(self, revision: str, targets: set[str] | None) -> tuple[NodeView, ...]:
        out = []
        for n in self.nodes.values():
            v = self.view(n, revision) if self.store else None
            out.append(
                NodeView(
                    name=n.name,
                    up=n.up,
                    slots=n.slots,
                    target=targets is None or n.name in targets,
                    cache=((revision, v),) if v is not None else (),
                )
            )
        return tuple(out)

    def replica_views(self) -> tuple[ReplicaView, ...]:
        return tuple(
            ReplicaView(r.id, r.model, r.revision, r.node, r.phase, r.routed, r.seq)  # type: ignore[arg-type]
            for r in self.replicas.values()
        )

    def live(self, model: str) -> int:
        return sum(
            1
            for r in self.replicas.values()
            if r.model == model and r.phase in ("starting", "ready")
        )

    def serving(self, model: str) -> int:
        return sum(1 for r in self.replicas.values() if r.model == model and r.phase == "ready")

    # --- the demand ledger ----------------------------------------------------------------

    def account(self, model: str, *, started: bool = False) -> None:
        """Replicas wanted and not live: a rise opens demand; a start fills it; any other
        fall (the demand went away first) withdraws it, counted as unmet."""
        ms = self.models[model]
        gap = max(ms.desired - self.live(model), 0)
        delta = gap - ms.gap
        if delta > 0:
            ms.opened += delta
        elif delta < 0 and started:
            ms.filled += -delta
        elif delta < 0:
            ms.withdrawn += -delta
        ms.gap = gap

    def mark_all(self) -> None:
        self.dirty.update(self.models)

    # --- actions ------------------------------------------------------------------------

    def execute(self, a: Action) -> None:
        if isinstance(a, Warm):
            self.warm(a.node, a.revision, a.variant)
        elif isinstance(a, StartReplica):
            self.start_replica(a)
        elif isinstance(a, AddRoute):
            r = self.replicas.get(a.replica)
            if r is not None and r.phase == "ready":
                r.routed = True
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
        elif isinstance(a, Rollback):
            ms = self.models[a.variant]
            ms.status = dataclasses.replace(
                ms.status, failed=ms.status.failed | {a.revision}, stable=ms.status.stable or a.to
            )
        elif isinstance(a, Unschedulable):
            self.models[a.variant].unschedulable += a.missing
        elif isinstance(a, DeleteRevision):
            node = self.nodes.get(a.node)
            snap = node.snaps.get(a.revision) if node else None
            if node is not None and snap is not None and not snap.leases:
                del node.snaps[a.revision]
        elif isinstance(a, Notice) and len(self.notices) < 100:
            self.notices.append(a.text)

    def _source(self, node: str, revision: str) -> str:
        if self.peers:
            holders = [
                n.name for n in self.nodes.values() if n.up and n.name != node and n.holds(revision)
            ]
            if holders:
                return min(holders, key=lambda h: (self.net.uploads(h), h))
        return ORIGIN

    def _fill(self, node: NodeDisk, spec: ModelSpec, owner: str) -> Fill | Refusal:
        if self.store:
            got = node.reserve(spec.revision, spec.size, self.agenda.now)
            if isinstance(got, Refusal):
                return got
            self.evictions.extend(got)
            for ev in got:
                self.dirty.add(ev.revision.removeprefix("rev-"))
        source = self._source(node.name, spec.revision)
        t = self.net.start(node.name, spec.revision, source, spec.size)
        fill = Fill(node.name, spec.revision, spec.size, t.id, source, owner)
        self.fills[(node.name, spec.revision)] = fill
        self.by_transfer[t.id] = fill
        self.failed_views.pop((node.name, spec.revision), None)
        return fill

    def warm(self, node_name: str, revision: str, model: str) -> None:
        node = self.nodes[node_name]
        if not node.up or node.holds(revision) or (node_name, revision) in self.fills:
            return
        got = self._fill(node, self.models[model].spec, "warm")
        if isinstance(got, Refusal):
            if got.permanent:
                self.failed_views[(node_name, revision)] = CacheView("unfit", reason=got.reason)
            else:
                # Retried when this node's space changes (``space_changed``), not on a timer.
                self.failed_views[(node_name, revision)] = CacheView(
                    "failed", reason=got.reason, retry_at=float("inf")
                )
            return
        self.warmups += 1
        spec = self.models[model].spec
        if spec.image is not None and not self.images.holds(node_name, spec.image):
            self.images.pull(node_name, spec.image, spec.image_size)  # modelCacheConfig.image

    def start_replica(self, a: StartReplica) -> None:
        ms = self.models[a.variant]
        node = self.nodes[a.node]
        if self.agenda.now < ms.next_start_at:
            return  # backing off after failed starts; a wake is scheduled
        reason = StartReason.INITIAL
        if a.reason == "rollout":
            reason = StartReason.ROLLOUT
        elif ms.lost_pending > 0:
            ms.lost_pending -= 1
            reason = StartReason.NODE_LOSS
        elif a.reason == "scale_out":
            reason = StartReason.SCALE_OUT
        holds = self.store and node.holds(a.revision)
        ctx = StartContext(
            reason=reason,
            node_had_revision=holds,
            node_is_new=node.added and not node.hosted_any,
        )
        node.hosted_any = True
        self._seq += 1
        now = self.agenda.now
        r = SimReplica(
            f"{a.variant}-{self._seq}",
            a.variant,
            a.revision,
            a.node,
            self._seq,
            classify_start(ctx),
            now,
        )
        self.replicas[r.id] = r
        self.account(a.variant, started=True)
        self.dirty.add(a.variant)
        self._image(r, ms.spec)
        if holds:
            r.bytes_from = {"cache": ms.spec.size}
            node.lease(a.revision, r.id, now)
            r.leased = True
            self._weights_ready(r)
            return
        fill = self.fills.get((a.node, a.revision))
        if fill is not None:
            fill.waiters.append(r.id)
            r.weights_source = fill.kind
            r.bytes_from = {fill.kind: 0, "cache": ms.spec.size}
            return
        if r.image_source == "pull" and self.catalog.startup.image_pull == "before":
            r.deferred_fill = True  # the weights download waits for the image
            r.weights_source = "origin"  # relabelled when the download starts
            return
        self._own_fill(r, node, ms)

    def _own_fill(self, r: SimReplica, node: NodeDisk, ms: ModelState) -> None:
        got = self._fill(node, ms.spec, r.id)
        if isinstance(got, Refusal):
            if got.permanent:
                self.failed_views[(r.node, r.revision)] = CacheView("unfit", reason=got.reason)
            r.weights_source = "origin"
            self._end(r, "failed", f"no room for the weights: {got.reason}")
            ms.start_failures += 1
            ms.next_start_at = self.agenda.now + min(0.5 * 2 ** (ms.start_failures - 1), 30.0)
            self.agenda.at(ms.next_start_at, "wake", r.model)
            return
        got.waiters.append(r.id)
        r.weights_source = got.kind
        r.bytes_from = {got.kind: ms.spec.size}

    def _image(self, r: SimReplica, spec: ModelSpec) -> None:
        if spec.image is None:
            return
        if self.images.holds(r.node, spec.image):
            r.image_source = "cache"
            r.stamps["image_ready"] = self.agenda.now
        else:
            r.image_source = "pull"
            self.images.pull(r.node, spec.image, spec.image_size, r.id)

    def _image_done(self, tid: int) -> None:
        pull = self.images.done(tid)
        if pull is None:
            return
        now = self.agenda.now
        for rid in pull.waiters:
            r = self.replicas.get(rid)
            if r is None or r.phase != "starting":
                continue
            r.stamps["image_ready"] = now
            if r.deferred_fill:
                r.deferred_fill = False
                node = self.nodes[r.node]
                if self.store and node.holds(r.revision):  # warmed meanwhile
                    r.weights_source, r.bytes_from = "cache", {"cache": node.snaps[r.revision].size}
                    node.lease(r.revision, r.id, now)
                    r.leased = True
                    self._weights_ready(r)
                elif (r.node, r.revision) in self.fills:
                    fill = self.fills[(r.node, r.revision)]
                    fill.waiters.append(r.id)
                    r.weights_source = fill.kind
                    r.bytes_from = {fill.kind: 0, "cache": fill.size}
                else:
                    self._own_fill(r, node, self.models[r.model])
            elif r.weights_at is not None:
                self._run(r)

    def _weights_ready(self, r: SimReplica) -> None:
        r.weights_at = self.agenda.now
        if r.image_source != "pull" or "image_ready" in r.stamps:
            self._run(r)

    def _run(self, r: SimReplica) -> None:
        """Image and weights are on the node: the runtime starts."""
        st = self.catalog.startup
        size = self.models[r.model].spec.size
        t = self.agenda.now
        r.stamps["weights_ready"] = t
        if r.restarts:
            t += min(0.2 * 2 ** (r.restarts - 1), 5.0) + st.restart_seconds  # supervisor
            r.stamps["runtime_started"] = t
            t += size / st.page_cache_bandwidth
        else:
            t += st.runtime_seconds
            r.stamps["runtime_started"] = t
            t += size / st.load_bandwidth
        r.stamps["weights_loaded"] = t
        t += st.warmup_seconds
        r.stamps["healthy"] = t
        t += self._first_response[r.model]
        r.stamps["first_response"] = t
        self.agenda.at(t, "ready", r.id)

    def replica_ready(self, rid: str) -> None:
        r = self.replicas.get(rid)
        if r is None or r.phase != "starting":
            return
        r.phase = "ready"
        self.models[r.model].start_failures = 0
        self._record(r, None)
        self.dirty.add(r.model)

    def crash(self, rid: str) -> None:
        """The ready replica's engine exited: the supervisor restarts it on its node."""
        r = self.replicas[rid]
        ms = self.models[r.model]
        r.restarts += 1
        self.restarts += 1
        r.phase, r.routed = "starting", False
        r.event_class = classify_start(
            StartContext(reason=StartReason.RESTART, same_replica_on_node_before=True)
        )
        r.scheduled = self.agenda.now
        r.stamps = {}
        r.weights_source, r.bytes_from = "cache", {"cache": ms.spec.size}
        if ms.spec.image is not None:
            r.image_source = "cache"
            r.stamps["image_ready"] = self.agenda.now
        self.dirty.add(r.model)
        self._run(r)

    def fill_done(self, tid: int) -> None:
        if tid in self.images.by_transfer:
            self._image_done(tid)
            return
        fill = self.by_transfer.pop(tid, None)
        t = self.net.remove(tid)
        if fill is None or t is None:
            return
        fill.fetched[fill.kind] += t.total
        del self.fills[(fill.node, fill.revision)]
        node = self.nodes[fill.node]
        now = self.agenda.now
        model = fill.revision.removeprefix("rev-")
        if self.store:
            spec = self.models[model].spec
            node.publish(
                fill.revision,
                fill.size,
                now,
                priority=spec.priority if self.priorities else 0,
                pinned=self.pins.get(model, False),
            )
        for rid in fill.waiters:
            r = self.replicas.get(rid)
            if r is None or r.phase != "starting":
                continue
            if self.store:
                node.lease(fill.revision, rid, now)
                r.leased = True
            self._weights_ready(r)
        self.dirty.add(model)  # a warm node for placement
        self.space_changed(fill.node)

    def resource(self, fill: Fill) -> None:
        """The fill's peer went away: go on with the rest from another source."""
        old = self.net.remove(fill.transfer)
        done = int(old.done) if old else 0
        fill.fetched[fill.kind] += done
        self.by_transfer.pop(fill.transfer, None)
        fill.source = self._source(fill.node, fill.revision)
        t = self.net.start(fill.node, fill.revision, fill.source, max(fill.size - done, 1))
        fill.transfer = t.id
        self.by_transfer[t.id] = fill

    def space_changed(self, node: str) -> None:
        """Warm-ups this node refused for room may fit now: let the planner retry them."""
        for key in [
            k for k, v in self.failed_views.items() if k[0] == node and v.state == "failed"
        ]:
            del self.failed_views[key]
            self.dirty.add(key[1].removeprefix("rev-"))

    def cancel_fill(self, fill: Fill) -> None:
        self.net.remove(fill.transfer)
        self.by_transfer.pop(fill.transfer, None)
        self.fills.pop((fill.node, fill.revision), None)
        node = self.nodes.get(fill.node)
        if node is not None:
            node.release(fill.revision)
            self.space_changed(node.name)

    def drain(self, rid: str, reason: str) -> None:
        r = self.replicas.get(rid)
        if r is None or r.phase not in ("starting", "ready"):
            return
        if r.phase == "starting":
            self.stop(rid, f"drained before it was ready ({reason})", failed=False)
            return
        r.phase = "draining"
        r.routed = False
        self.account(r.model)
        self.agenda.after(self.catalog.startup.drain_seconds, "drained", rid)

    def stop(self, rid: str, reason: str, *, failed: bool) -> None:
        r = self.replicas.get(rid)
        if r is None or r.phase in ("stopped", "failed"):
            return
        if r.phase == "starting":
            self._end(r, "failed" if failed else "stopped", f"stopped before ready: {reason}")
            return
        self._end(r, "stopped", None)

    def _end(self, r: SimReplica, phase: str, failure: str | None) -> None:
        was_starting = r.phase == "starting"
        r.phase = phase
        r.routed = False
        now = self.agenda.now
        node = self.nodes.get(r.node)
        if was_starting:
            self._record(r, failure)
            self.images.forget(r.id)
            for fill in list(self.fills.values()):
                if r.id in fill.waiters:
                    fill.waiters.remove(r.id)
                    if fill.owner == r.id and not fill.waiters:
                        self.cancel_fill(fill)
        if node is not None and r.leased:
            node.unlease(r.revision, r.id, now)
            self.space_changed(node.name)
        del self.replicas[r.id]
        self.account(r.model)
        self.mark_all()  # a slot is free

    def _record(self, r: SimReplica, failure: str | None) -> None:
        self.records.append(start_record(r, self.agenda.now, failure))
