"""A simulated replica's life: its start, readiness, crash restarts, drain and stop.

Pure. The executor's ``StartReplica``: classify the start (``telemetry.classify``), then
weights from the node's store (hit), from a fill already running there (the replica
waits for it, a miss as in ``warmup.pull_for_replica``), or a fill of its own (a miss).
Then the runtime starts, loads the weights from NVMe, warms up and answers its first
request (prefill time from the model's ``timing`` profile); readiness is scheduled ->
healthy. The runtime also needs the model's image (``coldstart_images``): from the
node's image store or a registry pull, at the same time as the weights or before them
(``startup.image_pull``); it starts once both are there.

A crash (``crash``): a ready replica's engine exits and the supervisor restarts it in
place (``warm_restart``): image and weights are on the node and the weights still in the
page cache, so it costs the supervisor's backoff, ``startup.restart_seconds``, the read
at ``startup.page_cache_bandwidth`` and the warm-up.

``Drain`` / ``StopReplica``: out of service; a drained replica stops after
``drain_seconds``; leases are released (the snapshot's last use is then). A start that
ends before it is ready is recorded with the stamps it reached, and the fill it alone
waited for is cancelled.
"""

from __future__ import annotations

from preheat.control.state import StartReplica
from preheat.sim.coldstart_config import ModelSpec, model_of
from preheat.sim.coldstart_fills import Fills, unfit_view
from preheat.sim.coldstart_replicas import ModelState, SimReplica, start_record
from preheat.sim.coldstart_store import NodeDisk, Refusal
from preheat.telemetry.classify import StartContext, StartReason, classify_start

__all__ = ["Lifecycle"]


class Lifecycle(Fills):
    """Replica starts, readiness, restarts and stops (see the module docstring)."""

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
            r.bytes_from = {"cache": self.sizes[a.revision]}
            node.lease(a.revision, r.id, now)
            r.leased = True
            self._weights_ready(r)
            return
        fill = self.fills.get((a.node, a.revision))
        if fill is not None:
            fill.waiters.append(r.id)
            r.weights_source = fill.kind
            r.bytes_from = {fill.kind: 0, "cache": fill.size}
            return
        if r.image_source == "pull" and self.catalog.startup.image_pull == "before":
            r.deferred_fill = True  # the weights download waits for the image
            r.weights_source = "origin"  # relabelled when the download starts
            return
        self._own_fill(r, node, ms)

    def _own_fill(self, r: SimReplica, node: NodeDisk, ms: ModelState) -> None:
        got = self._fill(node, r.revision, r.id)
        if isinstance(got, Refusal):
            if got.permanent:
                self.failed_views[(r.node, r.revision)] = unfit_view(got)
            r.weights_source = "origin"
            self._end(r, "failed", f"no room for the weights: {got.reason}")
            ms.start_failures += 1
            ms.next_start_at = self.agenda.now + min(0.5 * 2 ** (ms.start_failures - 1), 30.0)
            self.agenda.at(ms.next_start_at, "wake", r.model)
            return
        got.waiters.append(r.id)
        r.weights_source = got.kind
        r.bytes_from = {got.kind: got.size}

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
        size = self.sizes[r.revision]
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
        r.weights_source, r.bytes_from = "cache", {"cache": self.sizes[r.revision]}
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
        model = model_of(fill.revision)
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
        self.origin_freed()

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
