"""Cold-start simulation: a fleet with local NVMe, an autoscaler, churn, on virtual time.

Pure: virtual time (the shared ``sim.events.EventQueue``), randomness from the
``random.Random`` passed in, and
the live policy code for every decision: ``control.autoscale`` sets each model's
replica count from its in-flight demand; ``control.plan`` (and through it
``control.placement`` and ``control.rollout``) decides warm-ups, gates, starts, drains;
``store.evict.plan_eviction`` decides what leaves a full disk; ``telemetry.classify``
labels each start; ``timing`` gives the first response; ``telemetry.stats`` the
percentiles. The simulator only plays the executor (``coldstart_world``) and the world:
downloads and image pulls (``coldstart_flows``, ``coldstart_images``), replica crashes
restarted in place (``Traffic.crashes``: at each, a ready replica drawn from the seeded
``random.Random``), and the requests that queue while ready capacity is short
(``coldstart_queue``: per model, arrivals = demand / ``queue.request_seconds``,
capacity = ready replicas x ``replica_in_flight``).

Version changes (``releases`` per model, ``coldstart_releases``): at each, the model's
spec names a new revision and the same planner rolls it as live mode does
(``control.rollout``: the cache gate, surge, old replicas drained once new ones are
routed; starts classified ``new_version``). The planner sees every revision of the
model on each node, so it also deletes a superseded one once no replica uses it.

Each model is its own endpoint with one variant (its own ``Desired`` and cache policy);
every plan sees all replicas, so slots are shared across models as on a real fleet.
The planner is level-triggered, so it runs only for models whose inputs changed (their
count, their replicas, a node's cache of their revision, a freed slot, a timer), which
gives the same actions as planning everything at every instant, much faster.

Cache policies (``--cache-policy``), as ``modelCacheConfig.weights`` per model:

- ``none``: no node store; every replica downloads the weights into scratch space.
- ``warm-all``: weights enabled on every node: the planner warms every node with every
  model (eviction decides when the disk is too small) and gates first deployments.
- ``lru``: no warm-ups; what replicas pulled stays on the node until evicted by least
  recent use; placement prefers nodes that hold the revision.
- ``priority``: ``lru`` with each model's ``priority`` as the snapshot priority, and
  models with ``pin: true`` warmed on every node and pinned (never evicted).
- ``predictive``: weights enabled with ``min_ready: 0`` (never gates) on the nodes the
  planner would use next: at each autoscaler sample the demand is extrapolated over the
  last ``PREDICT_WINDOW`` seconds to ``PREDICT_HORIZON`` ahead, and ``control.placement``
  places the replicas that forecast adds (at least one) to choose the target nodes.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import TYPE_CHECKING

from preheat.control.autoscale import AutoscaleState, autoscale
from preheat.control.fanout import Budget
from preheat.control.placement import place
from preheat.control.plan import plan
from preheat.control.state import Desired, DesiredVariant, Observed, WeightsPolicy
from preheat.sim.coldstart_flows import Network
from preheat.sim.coldstart_queue import ModelQueue
from preheat.sim.coldstart_replicas import ModelState
from preheat.sim.coldstart_result import ColdStartResult, summarize
from preheat.sim.coldstart_setup import ColdStartSetup
from preheat.sim.coldstart_store import NodeDisk
from preheat.sim.coldstart_world import World
from preheat.sim.events import EventQueue

if TYPE_CHECKING:
    import random

__all__ = ["PREDICT_HORIZON", "PREDICT_WINDOW", "ColdStartSetup", "simulate"]

PREDICT_WINDOW = 600.0  # seconds of demand history the forecast's slope is taken over
PREDICT_HORIZON = 900.0  # how far ahead predictive warming looks (about one warm-up)
PREDICT_EVERY = 300.0  # seconds between forecasts (each places every model once)
_MAX_PASSES = 8  # plan passes per instant before carrying the rest to the next event


class _Sim:
    def __init__(self, setup: ColdStartSetup, rng: random.Random) -> None:
        self.s = setup
        self.budget = None if setup.warm_budget is None else Budget(setup.warm_budget)
        self.rng = rng
        self.agenda = EventQueue()
        self.net = Network(
            origin_bandwidth=setup.origin_bandwidth,
            node_bandwidth=setup.node_bandwidth,
            registry_bandwidth=setup.registry_bandwidth,
        )
        cat = setup.catalog
        self.w = World(
            cat,
            self.agenda,
            self.net,
            store=setup.policy != "none",
            peers=setup.peers,
            priorities=setup.policy == "priority",
            budget=self.budget,
        )
        self.hi = setup.nodes * setup.slots
        self._node_index = 0
        for _ in range(setup.nodes):
            self._add_node(added=False)
        for m in cat.models:
            self.w.models[m.name] = ModelState(m, desired=m.min_replicas)
            self.w.pins[m.name] = setup.policy == "priority" and m.pin
        self.scale_state = {m.name: AutoscaleState() for m in cat.models}
        self.targets: dict[str, set[str]] = {m.name: set() for m in cat.models}
        self.history: dict[str, deque[tuple[float, float]]] = {m.name: deque() for m in cat.models}
        self.needed: dict[str, int] = dict.fromkeys(self.w.models, 0)
        self.shortfall = 0
        self.unmet_s = 0.0
        self.unmet_replica_s = 0.0
        self.last_t = 0.0
        self.flow_epoch = 0
        self.flow_at: float | None = None
        self.interruptions = 0
        self.releases = 0
        self.next_predict = 0.0
        self.queues = {m.name: ModelQueue(cat.queue.max_queued) for m in cat.models}
        self.arrivals = dict.fromkeys(self.w.models, 0.0)
        for m in cat.models:
            self.w.account(m.name)
        # The first plan is for every model, not only those whose count the first sample
        # changes (a model kept at min_replicas would wait for some other replica to stop).
        self.w.mark_all()

    def max_of(self, name: str) -> int:
        """``max_replicas``, by default twice the model's share of the fleet's slots."""
        spec = self.w.models[name].spec
        if spec.max_replicas is not None:
            return spec.max_replicas
        share = self.s.catalog.shares[name]
        return max(2, spec.min_replicas, math.ceil(2 * share * self.hi))

    # --- nodes ----------------------------------------------------------------------------

    def _add_node(self, *, added: bool) -> None:
        name = f"node-{self._node_index:03d}"
        self._node_index += 1
        cap = int(self.s.nvme * self.s.high_watermark)
        self.w.nodes[name] = NodeDisk(name, cap, self.s.slots, added=added)

    def _interrupt(self) -> None:
        up = sorted(n.name for n in self.w.nodes.values() if n.up)
        if not up:
            return
        node = self.w.nodes[self.rng.choice(up)]
        node.up = False
        self.interruptions += 1
        for r in self.w.replicas.values():
            if r.node == node.name and r.phase in ("starting", "ready"):
                self.w.models[r.model].lost_pending += 1
        self.w.images.lose(node.name)
        for fill in list(self.w.fills.values()):
            if fill.node == node.name:
                self.w.cancel_fill(fill)
            elif fill.source == node.name:
                self.w.resource(fill)
        self.w.mark_all()
        self.agenda.after(self.s.traffic.replace_seconds, "replace")

    # --- the autoscaler and predictive targets --------------------------------------------

    def _sample(self) -> None:
        now = self.agenda.now
        demand = self.s.traffic.at(now)
        policy = self.s.catalog.autoscaling
        for name, ms in self.w.models.items():
            d = demand.get(name, 0.0)
            self.arrivals[name] = d / self.s.catalog.queue.request_seconds
            self.needed[name] = math.ceil(d / policy.target_in_flight - 1e-9)
            hi = self.max_of(name)
            new, state, _why = autoscale(
                current=ms.desired,
                lo=ms.spec.min_replicas,
                hi=hi,
                in_flight=d,
                serving=self.w.serving(name),
                policy=policy,
                now=now,
                state=self.scale_state[name],
            )
            self.scale_state[name] = state
            h = self.history[name]
            h.append((now, d))
            while h and now - h[0][0] > PREDICT_WINDOW:
                h.popleft()
            if new != ms.desired:
                ms.desired = new
                self.w.account(name)
                self.w.dirty.add(name)
        if self.s.policy == "predictive" and now >= self.next_predict:
            self.next_predict = now + PREDICT_EVERY
            self._predict()
        nxt = now + self.s.catalog.traffic.sample_seconds
        if nxt < self.s.duration:
            self.agenda.at(nxt, "sample")

    def _predict(self) -> None:
        policy = self.s.catalog.autoscaling
        replicas = self.w.replica_views()
        planned: Counter[str] = Counter()
        for name, ms in sorted(self.w.models.items(), key=lambda kv: -kv[1].spec.popularity):
            h = self.history[name]
            (t0, d0), (t1, d1) = h[0], h[-1]
            slope = (d1 - d0) / (t1 - t0) if t1 > t0 else 0.0
            forecast = d1 + max(slope, 0.0) * PREDICT_HORIZON
            hi = self.max_of(name)
            extra = min(
                max(math.ceil(forecast / policy.target_in_flight) - ms.desired, 1), hi - ms.desired
            )
            chosen: set[str] = set()
            if extra > 0:
                views = self.w.node_views(name, None)
                placements, _ = place(
                    views,
                    replicas,
                    variant=name,
                    revision=ms.revision,
                    count=extra,
                    planned=planned,
                )
                for p in placements:
                    planned[p.node] += 1
                chosen = {p.node for p in placements}
            if chosen != self.targets[name]:
                self.targets[name] = chosen
                self.w.dirty.add(name)

    # --- planning -------------------------------------------------------------------------

    def _weights(self, name: str) -> tuple[WeightsPolicy, set[str] | None]:
        p = self.s.policy
        ms = self.w.models[name]
        timeout = self.s.catalog.gate_timeout_seconds
        if p == "warm-all":
            return WeightsPolicy(enabled=True, timeout_seconds=timeout), None
        if p == "priority" and ms.spec.pin:
            return (
                WeightsPolicy(
                    enabled=True, timeout_seconds=timeout, pin=True, priority=ms.spec.priority
                ),
                None,
            )
        if p == "predictive":
            return WeightsPolicy(enabled=True, min_ready=0), self.targets[name]
        return WeightsPolicy(), None

    def _plan_model(self, name: str) -> None:
        ms = self.w.models[name]
        weights, targets = self._weights(name)
        desired = Desired(
            endpoint=name,
            variants=(DesiredVariant(name, ms.revision, ms.size, ms.desired),),
            weights=weights,
        )
        observed = Observed(
            now=self.agenda.now,
            nodes=self.w.node_views(name, targets),
            replicas=self.w.replica_views(),
            variants=((name, ms.status),),
        )
        for action in plan(desired, observed):
            self.w.execute(action)

    def _reconcile(self) -> None:
        order = list(self.w.models)
        for _ in range(_MAX_PASSES):
            if not self.w.dirty:
                break
            todo = [m for m in order if m in self.w.dirty]
            self.w.dirty.clear()
            for name in todo:
                self._plan_model(name)
        for name in [n.name for n in self.w.nodes.values() if not n.up]:
            if not any(r.node == name for r in self.w.replicas.values()):
                del self.w.nodes[name]  # lost with its disk; its replicas are gone
        ready = Counter(r.model for r in self.w.replicas.values() if r.phase == "ready")
        short = {m: max(self.needed[m] - ready[m], 0) for m in self.w.models}
        self.shortfall = sum(short.values())
        per = self.s.catalog.replica_in_flight / self.s.catalog.queue.request_seconds
        for m, q in self.queues.items():
            q.set_rates(self.arrivals[m], ready[m] * per)
        nxt = self.net.next_finish()
        if nxt is not None and nxt[0] != self.flow_at:
            self.flow_epoch += 1
            self.flow_at = nxt[0]
            self.agenda.at(nxt[0], "flow", self.flow_epoch)

    # --- the run --------------------------------------------------------------------------

    def run(self) -> ColdStartResult:
        self.agenda.at(0.0, "sample")
        for t in self.s.traffic.interruptions:
            self.agenda.at(t, "interrupt")
        for t in self.s.traffic.crashes:
            self.agenda.at(t, "crash")
        for m in self.s.catalog.models:
            for k, rel in enumerate(m.releases, start=1):
                self.agenda.at(rel.at, "release", (m.name, k))
        self.agenda.at(self.s.duration, "end")
        while len(self.agenda):
            ev = self.agenda.pop()
            now = ev.time
            dt = now - self.last_t
            if self.shortfall:
                self.unmet_s += dt
                self.unmet_replica_s += dt * self.shortfall
            if dt > 0:
                for q in self.queues.values():
                    q.advance(self.last_t, now)
            self.last_t = now
            self.net.advance(now)
            if ev.kind == "end":
                break
            self._handle(str(ev.kind), ev.payload)
            if self.agenda.peek_time() != now:
                self._reconcile()
        return summarize(
            self.s,
            self.w,
            unmet_s=self.unmet_s,
            unmet_replica_s=self.unmet_replica_s,
            interruptions=self.interruptions,
            releases=self.releases,
            queues=self.queues,
        )

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "sample":
            self._sample()
        elif kind == "flow":
            if payload != self.flow_epoch:
                return
            self.flow_at = None
            for t in [t for t in self.net.transfers.values() if t.left <= 1.0]:
                self.w.fill_done(t.id)
        elif kind == "ready":
            self.w.replica_ready(str(payload))
        elif kind == "drained":
            self.w.stop(str(payload), "drained", failed=False)
        elif kind == "wake":
            self.w.dirty.add(str(payload))
        elif kind == "interrupt":
            self._interrupt()
        elif kind == "crash":
            ready = sorted(r.id for r in self.w.replicas.values() if r.phase == "ready")
            if ready:
                self.w.crash(self.rng.choice(ready))
        elif kind == "replace":
            self._add_node(added=True)
            self.w.mark_all()
        elif kind == "release":
            assert isinstance(payload, tuple)
            model, k = payload
            ms = self.w.models[str(model)]
            ms.release = int(k)  # the spec names a new revision
            self.w.released_at[ms.revision] = self.agenda.now
            self.releases += 1
            self.w.dirty.add(str(model))


def simulate(setup: ColdStartSetup, rng: random.Random) -> ColdStartResult:
    """Run one cold-start simulation (see the module docstring)."""
    return _Sim(setup, rng).run()
