"""Version changes: warm new, surge, drain old only after new is routed, delete old cache;
roll back on failure. Driven through a tiny deterministic world that applies the plan's
actions the way the executor does (one tick per step)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from preheat.control.plan import plan
from preheat.control.rollout import effective_version
from preheat.control.state import (
    AddRoute,
    CacheView,
    DeleteRevision,
    Desired,
    DesiredVariant,
    Drain,
    FinishRollout,
    NodeView,
    Observed,
    OpenGate,
    ReplicaView,
    Rollback,
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


@dataclass
class World:
    """Applies actions instantly; a started replica becomes ready on the next tick
    (or fails, for revisions listed in ``broken``); warming takes ``warm_ticks``."""

    nodes: dict[str, dict[str, str]]
    broken: set[str] = field(default_factory=set)
    warm_ticks: int = 1
    slots: int = 2
    replicas: dict[str, ReplicaView] = field(default_factory=dict)
    status: VariantStatus = field(default_factory=VariantStatus)
    now: float = 0.0
    seq: int = 0
    log: list[object] = field(default_factory=list)
    _warming: dict[tuple[str, str], int] = field(default_factory=dict)

    def observed(self) -> Observed:
        return Observed(
            now=self.now,
            nodes=tuple(
                NodeView(
                    name,
                    slots=self.slots,
                    cache=tuple((r, CacheView(s)) for r, s in sorted(cache.items())),  # type: ignore[arg-type]
                )
                for name, cache in sorted(self.nodes.items())
            ),
            replicas=tuple(self.replicas.values()),
            variants=(("main", self.status),),
        )

    def serving(self) -> list[ReplicaView]:
        return [r for r in self.replicas.values() if r.phase == "ready" and r.routed]

    def tick(self, d: Desired) -> tuple[object, ...]:
        # Progress of work started on earlier ticks.
        for key in list(self._warming):
            self._warming[key] -= 1
            if self._warming[key] <= 0:
                del self._warming[key]
                self.nodes[key[0]][key[1]] = "ready"
        for rid, r in list(self.replicas.items()):
            if r.phase == "starting":
                phase = "failed" if r.revision in self.broken else "ready"
                self.replicas[rid] = dataclasses.replace(r, phase=phase)  # type: ignore[arg-type]
                if phase == "ready":
                    self.nodes[r.node][r.revision] = "ready"
            elif r.phase == "draining":
                self.replicas[rid] = dataclasses.replace(r, phase="stopped", routed=False)
        acts = plan(d, self.observed())
        st = self.status
        for a in acts:
            self.log.append(a)
            if isinstance(a, Warm):
                self.nodes[a.node][a.revision] = "warming"
                self._warming[(a.node, a.revision)] = self.warm_ticks
            elif isinstance(a, WaitGate) and st.waiting_since(a.revision) is None:
                st = dataclasses.replace(st, gate_since=(*st.gate_since, (a.revision, self.now)))
            elif isinstance(a, OpenGate):
                st = dataclasses.replace(st, gate_open=st.gate_open | {a.revision})
            elif isinstance(a, StartReplica):
                self.seq += 1
                rid = f"r{self.seq}"
                self.replicas[rid] = ReplicaView(
                    rid,
                    a.variant,
                    a.revision,
                    a.node,
                    "starting",
                    seq=self.seq,
                    template=a.template,
                )
            elif isinstance(a, AddRoute):
                self.replicas[a.replica] = dataclasses.replace(
                    self.replicas[a.replica], routed=True
                )
            elif isinstance(a, Drain):
                self.replicas[a.replica] = dataclasses.replace(
                    self.replicas[a.replica], phase="draining", routed=False
                )
            elif isinstance(a, StopReplica):
                self.replicas[a.replica] = dataclasses.replace(
                    self.replicas[a.replica], phase="stopped", routed=False
                )
            elif isinstance(a, FinishRollout):
                st = dataclasses.replace(st, stable=a.revision)
            elif isinstance(a, Rollback):
                st = dataclasses.replace(st, failed=st.failed | {a.revision})
            elif isinstance(a, DeleteRevision):
                del self.nodes[a.node][a.revision]
        self.status = st
        self.now += 1
        return acts


def desired(rev: str, replicas: int = 2) -> Desired:
    return Desired(
        "chat",
        (DesiredVariant("main", rev, 1000, replicas),),
        weights=WeightsPolicy(enabled=True, timeout_seconds=100),
    )


def settle(w: World, d: Desired, ticks: int = 30) -> None:
    for _ in range(ticks):
        w.tick(d)


def test_initial_deploy_then_rollout_without_downtime() -> None:
    """R1 deploys after warm-up; R2 is warmed first, surged in, old drained only after the
    new replica is routed; serving never drops below desired; R1's cache is deleted."""
    w = World(nodes={"a": {}, "b": {}, "c": {}})
    settle(w, desired(R1))
    assert w.status.stable == R1
    assert sorted(r.revision for r in w.serving()) == [R1, R1]

    w.log.clear()
    d2 = desired(R2)
    min_serving = 99
    for _ in range(30):
        w.tick(d2)
        min_serving = min(min_serving, len(w.serving()))
    assert min_serving >= 2
    assert w.status.stable == R2
    assert sorted(r.revision for r in w.serving()) == [R2, R2]
    kinds = [type(a).__name__ for a in w.log]
    # Warm-up of R2 on all three targets happened before any R2 replica was created.
    first_start = kinds.index("StartReplica")
    warms = [i for i, a in enumerate(w.log) if isinstance(a, Warm) and a.revision == R2]
    assert len(warms) == 3 and max(warms) < first_start
    # Every drain of an R1 replica comes after an R2 replica was routed.
    first_route_new = next(
        i
        for i, a in enumerate(w.log)
        if isinstance(a, AddRoute) and w.replicas[a.replica].revision == R2
    )
    first_drain = kinds.index("Drain")
    assert first_route_new < first_drain
    # Old revision deleted from every node afterwards.
    assert all(R1 not in cache for cache in w.nodes.values())
    assert all(cache.get(R2) == "ready" for cache in w.nodes.values())


def test_surge_is_bounded() -> None:
    """During a rollout at most desired + max_surge replicas are live at once."""
    w = World(nodes={"a": {}, "b": {}, "c": {}})
    settle(w, desired(R1, 3))
    d2 = desired(R2, 3)
    for _ in range(30):
        w.tick(d2)
        live = [r for r in w.replicas.values() if r.phase in ("starting", "ready")]
        assert len(live) <= 4
    assert w.status.stable == R2


def test_failed_rollout_rolls_back_and_keeps_serving() -> None:
    """A new revision whose replica fails is marked failed; the old replicas keep serving,
    the new ones are cleaned up and R2's cache is deleted."""
    w = World(nodes={"a": {}, "b": {}}, broken={R2})
    settle(w, desired(R1))
    d2 = desired(R2)
    for _ in range(20):
        w.tick(d2)
        assert len(w.serving()) >= 2
    assert R2 in w.status.failed and w.status.stable == R1
    assert effective_version(R2, w.status) == R1
    assert any(isinstance(a, Rollback) for a in w.log)
    assert sorted(r.revision for r in w.serving()) == [R1, R1]
    live_r2 = [r for r in w.replicas.values() if r.revision == R2 and r.phase != "stopped"]
    assert live_r2 == []
    assert all(R2 not in cache for cache in w.nodes.values())


def test_slow_warmup_keeps_old_version_serving() -> None:
    """While R2 is still warming, the gate holds and R1 replicas are untouched."""
    w = World(nodes={"a": {}, "b": {}}, warm_ticks=5)
    settle(w, desired(R1), ticks=12)
    d2 = desired(R2)
    acts = w.tick(d2)
    assert any(isinstance(a, WaitGate) for a in acts)
    assert not any(isinstance(a, StartReplica | Drain) for a in acts)
    assert sorted(r.revision for r in w.serving()) == [R1, R1]
    settle(w, d2)
    assert w.status.stable == R2


def test_plan_is_repeatable() -> None:
    """The same observed state always gives the same actions (no hidden state, no clock)."""
    w = World(nodes={"a": {R1: "ready"}, "b": {}})
    obs = w.observed()
    assert plan(desired(R1), obs) == plan(desired(R1), obs)


def test_full_nodes_roll_one_unavailable_at_a_time() -> None:
    """With every slot taken, one old replica is drained to make room (never more than
    one down at a time); the rollout completes."""
    w = World(nodes={"a": {}, "b": {}, "c": {}}, slots=1)
    settle(w, desired(R1, 3))
    assert len(w.serving()) == 3
    d2 = desired(R2, 3)
    for _ in range(40):
        w.tick(d2)
        assert len(w.serving()) >= 2
    assert w.status.stable == R2
    assert sorted(r.revision for r in w.serving()) == [R2, R2, R2]


def test_single_replica_without_room_waits_and_says_why() -> None:
    """One replica and no free slot: the old one keeps serving, the plan says why."""
    w = World(nodes={"a": {}}, slots=1)
    settle(w, desired(R1, 1))
    for _ in range(10):
        acts = w.tick(desired(R2, 1))
    assert [r.revision for r in w.serving()] == [R1]
    assert any(isinstance(a, Unschedulable) for a in acts)


def test_engine_or_image_change_rolls_without_moving_weights() -> None:
    """A new template (engine command, image) on the same revision rolls every replica
    but warms nothing and deletes nothing."""
    w = World(nodes={"a": {}, "b": {}})
    settle(w, desired(R1))
    w.log.clear()
    d2 = dataclasses.replace(
        desired(R1), variants=(DesiredVariant("main", R1, 1000, 2, template="img2"),)
    )
    for _ in range(30):
        w.tick(d2)
        assert len(w.serving()) >= 2
    assert w.status.stable == f"{R1}#img2"
    assert all(r.template == "img2" for r in w.serving())
    assert not any(isinstance(a, Warm | DeleteRevision) for a in w.log)
    assert any(isinstance(a, Drain) for a in w.log)


def test_rollback_before_first_rollout_was_recorded() -> None:
    """With no stable version recorded yet, the version the other ready replicas agree on
    is the one to go back to."""
    from preheat.control.rollout import rollback_needed

    reps = [
        ReplicaView("r1", "main", R1, "a", "ready", routed=True, seq=1),
        ReplicaView("r2", "main", R2, "b", "failed", seq=2),
    ]
    rb = rollback_needed(desired(R2).variants[0], VariantStatus(), reps)
    assert rb is not None and rb.to == R1 and rb.revision == R2
    # Two different old versions: nothing to agree on, no rollback.
    reps.append(ReplicaView("r3", "main", "sha256-3333", "c", "ready", routed=True, seq=3))
    assert rollback_needed(desired(R2).variants[0], VariantStatus(), reps) is None
