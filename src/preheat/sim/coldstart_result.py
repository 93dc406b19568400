"""What a cold-start simulation reports (pure): readiness per event class, misses, bytes.

Readiness is ``StartRecord.ready_seconds`` (scheduled -> healthy) and the per-class
figures come from ``telemetry.stats.summarize_classes``, the code behind ``preheat
report``, so a simulated fleet and a live one are read the same way. The share of starts
that miss the cache counts every start whose weights were not on its node (from a peer
or the origin, including a wait for a warm-up already running there), over all starts
that finished (became ready or failed) in the run.

The demand ledger: ``opened`` counts replicas the autoscaler (or a lost node) made
wanted and not live; each is either ``filled`` by a start, ``withdrawn`` (demand fell
before a replica started: unmet while it lasted) or still ``open_at_end``. ``filled``
plus the crash restarts (each a start record of its own, ``warm_restart``) equals the
starts made (finished plus still starting at the end).

Version changes (``releases`` in the models file): ``releases`` made, rollouts that
finished (``FinishRollout`` from a previous revision), superseded revisions the planner
deleted from a node once no replica used them (``revisions_deleted``), and the bytes of
superseded revisions still on the disks at the end (``superseded_bytes_at_end``); their
starts are the ``new_version`` class. ``rollout_s`` is how long each finished rollout
took, from its release to ``FinishRollout`` (the new revision serves every wanted replica
and the old one is drained): n, p50, p95, p99, max, and each revision's in
``rollout_s_by_revision``; ``rollouts_unfinished`` counts releases
whose rollout had not finished at the end or was overtaken by a later release.

Queueing (``queue``, from ``coldstart_queue``): requests that arrived, waited, were
dropped at the bound or still wait at the end; the wait p50/p99/max is over every
request that was served (most wait 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from preheat.sim.coldstart_flows import kind
from preheat.sim.coldstart_queue import summarize_queues
from preheat.telemetry.stats import Percentiles, summarize_classes

if TYPE_CHECKING:
    from preheat.sim.coldstart_setup import ColdStartSetup
    from preheat.sim.coldstart_world import World

__all__ = ["ColdStartResult", "summarize"]


@dataclass(frozen=True)
class ColdStartResult:
    summary: dict[str, Any]
    world: World

    def to_dict(self) -> dict[str, Any]:
        return self.summary


def _spread(values: list[float]) -> dict[str, float | int]:
    """n, p50, p95, p99 and max of ``values`` (zeros for none), rounded to ms, in the
    shape of a ``readiness`` row."""
    if not values:
        return {"n": 0, "p50_s": 0.0, "p95_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    p = Percentiles.of(values)
    return {
        "n": p.n,
        "p50_s": round(p.p50, 3),
        "p95_s": round(p.p95, 3),
        "p99_s": round(p.p99, 3),
        "max_s": round(p.max, 3),
    }


def summarize(
    setup: ColdStartSetup,
    world: World,
    *,
    unmet_s: float,
    unmet_replica_s: float,
    interruptions: int,
    releases: int,
    queues: dict[str, Any],
) -> ColdStartResult:
    records = world.records
    classes = summarize_classes(records)
    misses = sum(c.weights_misses for c in classes)
    starts = len(records)
    readiness = {
        c.event_class.value: {
            "n": c.ready.n,
            "p50_s": round(c.ready.p50, 3),
            "p95_s": round(c.ready.p95, 3),
            "p99_s": round(c.ready.p99, 3),
            "max_s": round(c.ready.max, 3),
        }
        for c in classes
        if c.ready is not None
    }
    per_class = {
        c.event_class.value: {
            "starts": c.starts,
            "failures": c.failures,
            "misses": c.weights_misses,
            "miss_share": round(c.weights_misses / c.starts, 4) if c.starts else 0.0,
            "image_pulls": c.image_misses,
        }
        for c in classes
    }
    ledger = {"opened": 0, "filled": 0, "withdrawn": 0, "open_at_end": 0}
    unschedulable = 0
    for ms in world.models.values():
        ledger["opened"] += ms.opened
        ledger["filled"] += ms.filled
        ledger["withdrawn"] += ms.withdrawn
        ledger["open_at_end"] += ms.gap
        unschedulable += ms.unschedulable
    moved = dict(world.net.bytes_from)
    for t in world.net.transfers.values():  # still in flight at the end
        moved[kind(t.source)] = moved.get(kind(t.source), 0) + round(t.done)
    current = {ms.revision for ms in world.models.values()}
    superseded = sum(
        s.size for n in world.nodes.values() for rev, s in n.snaps.items() if rev not in current
    )
    in_progress = sum(1 for r in world.replicas.values() if r.phase == "starting")
    queue = summarize_queues(queues).to_dict()
    summary: dict[str, Any] = {
        "policy": setup.policy,
        "pattern": setup.traffic.name,
        "nodes": setup.nodes,
        "slots": setup.slots,
        "nvme_bytes": setup.nvme,
        "models": len(setup.catalog.models),
        "model_bytes": sum(m.size for m in setup.catalog.models),
        "peers": setup.peers,
        "seed": setup.seed,
        "duration_s": setup.duration,
        "origin_bandwidth_bytes_per_s": setup.origin_bandwidth,
        "registry_bandwidth_bytes_per_s": setup.registry_bandwidth,
        "starts": starts,
        "starts_in_progress": in_progress,
        "failed_starts": sum(1 for r in records if not r.ok),
        "cache_misses": misses,
        "cache_miss_share": round(misses / starts, 4) if starts else 0.0,
        "origin_bytes": moved.get("origin", 0),
        "peer_bytes": moved.get("peer", 0),
        "registry_bytes": moved.get("registry", 0),
        "image_pulls": world.images.pulled,
        "image_pull_starts": sum(1 for r in records if r.image_source == "pull"),
        "restarts": world.restarts,
        "queue": queue,
        "queue_wait_p50_s": queue["wait_p50_s"],
        "queue_wait_p99_s": queue["wait_p99_s"],
        "dropped_requests": queue["dropped"],
        "unmet_demand_s": round(unmet_s, 1),
        "unmet_demand_share": round(unmet_s / setup.duration, 4),
        "unmet_replica_s": round(unmet_replica_s, 1),
        "readiness": readiness,
        "classes": per_class,
        "warmups": world.warmups,
        "evictions": len(world.evictions),
        "interruptions": interruptions,
        "releases": releases,
        "rollouts_finished": world.rollouts_finished,
        "rollout_s": _spread(list(world.rollout_seconds.values())),
        "rollout_s_by_revision": {k: round(v, 3) for k, v in world.rollout_seconds.items()},
        "rollouts_unfinished": len(world.released_at),
        "revisions_deleted": len(world.deleted),
        "superseded_bytes_at_end": superseded,
        "demand": ledger,
        "unschedulable": unschedulable,
    }
    return ColdStartResult(summary, world)
