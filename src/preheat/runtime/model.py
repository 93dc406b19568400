"""The local fleet's bookkeeping: nodes, replicas, resolved revisions and their phases.

Phases are enums whose values are the strings the planner (``control.state``) and the
status document use, so ``Replica.phase == "ready"`` and JSON output stay as they were:

- ``ReplicaPhase``: ``starting`` (weights, process, health, first response) -> ``ready``
  (the router may add it) -> ``draining`` (out of the router, in-flight requests
  finishing) -> ``stopped`` (process gone, lease released); ``failed`` when a start
  failed or it crashed too often (the planner replaces it or rolls back).
- ``NodePhase``: ``up`` or ``down`` (``preheat node fail``; back with ``node add``).
- ``WarmState``: one revision on one node: ``absent`` -> ``warming`` -> ``ready``, or
  ``failed`` (retried with backoff, reason shown) or ``unfit`` (the disk cannot hold it).

``FleetState`` is the one mutable record the executor, warm-ups, replica supervision
and status rendering share; all of it lives on the event loop that started the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

from preheat.clock import Clock
from preheat.control.spec import ClusterSpec, EndpointSpec, NodeSpec, VariantSpec
from preheat.control.state import CacheState, CacheView, VariantStatus
from preheat.errors import ControlError
from preheat.runtime.fleetlog import FleetLog
from preheat.runtime.nodestore import NodeCache
from preheat.runtime.procs import Child
from preheat.telemetry.classify import StartReason
from preheat.telemetry.inventory import WarmupFailure
from preheat.telemetry.records import WarmupRecord

__all__ = [
    "FleetState",
    "Node",
    "NodePhase",
    "Replica",
    "ReplicaPhase",
    "ResolvedVariant",
    "WarmState",
    "cache_view",
]


class ReplicaPhase(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def live(self) -> bool:
        """The process exists or is being brought up (a node loss kills it)."""
        return self in (ReplicaPhase.STARTING, ReplicaPhase.READY, ReplicaPhase.DRAINING)


class NodePhase(StrEnum):
    UP = "up"
    DOWN = "down"


class WarmState(StrEnum):
    ABSENT = "absent"
    WARMING = "warming"
    READY = "ready"
    FAILED = "failed"
    UNFIT = "unfit"


def cache_view(
    state: WarmState, reason: str = "", retry_at: float = 0.0, *, short_of_room: bool = False
) -> CacheView:
    """The planner's ``CacheView`` of a warm-up state (its ``state`` is the enum's value)."""
    return CacheView(
        cast(CacheState, state.value), reason=reason, retry_at=retry_at, short_of_room=short_of_room
    )


@dataclass(frozen=True)
class ResolvedVariant:
    """A variant's source resolved once, when the spec was applied."""

    variant: str
    source: str
    revision: str
    model_bytes: int
    files: int


@dataclass
class Node:
    spec: NodeSpec
    cache: NodeCache
    phase: NodePhase = NodePhase.UP
    #: Joined by ``node add`` while the fleet ran (not in the cluster file). With
    #: ``hosted_any`` this makes a start ``new_node`` (see ``is_new``).
    added: bool = False
    #: Has hosted (started) a replica of this endpoint.
    hosted_any: bool = False
    views: dict[str, CacheView] = field(default_factory=dict)
    warm_failures: Counter[str] = field(default_factory=Counter)
    warm_tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    last_failure: WarmupFailure | None = None

    @property
    def up(self) -> bool:
        return self.phase is NodePhase.UP

    @property
    def name(self) -> str:
        return self.spec.name

    def holds(self, revision: str) -> bool:
        return self.views.get(revision, cache_view(WarmState.ABSENT)).state == WarmState.READY

    @property
    def is_new(self) -> bool:
        """A node is new to the endpoint until it hosts a replica, if it joined by ``node
        add`` while the fleet ran: after the first replica became healthy, or while the
        first replicas were still starting (it never hosted one either way). Nodes of the
        cluster file are not new: they were there when the deployment was planned, so a
        first start on one is ``scale_out`` or ``cold_pod_warm_node`` (see
        ``telemetry.classify``)."""
        return self.added and not self.hosted_any


@dataclass
class Replica:
    id: str
    variant: str
    revision: str
    node: str
    seq: int
    reason: StartReason
    template: str = ""
    phase: ReplicaPhase = ReplicaPhase.STARTING
    routed: bool = False
    port: int = 0
    child: Child | None = None
    lease: Any = None
    snapshot: Path | None = None
    restarts: int = 0
    restart_times: deque[float] = field(default_factory=deque)
    detail: str = "scheduled"
    stopping: bool = False
    task: asyncio.Task[None] | None = None
    weights_source: str = "cache"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class FleetState:
    """Everything the fleet knows, shared by its parts (one event loop, no locking)."""

    spec: EndpointSpec
    cluster: ClusterSpec
    state_dir: Path
    clock: Clock
    log: FleetLog
    #: Wakes the reconcile loop before its next tick (something changed).
    wake: Callable[[], None]
    nodes: dict[str, Node] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    resolved: dict[str, ResolvedVariant] = field(default_factory=dict)
    #: Every revision resolved so far (old ones serve until rolled out, or come back on a
    #: rollback).
    known: dict[str, ResolvedVariant] = field(default_factory=dict)
    #: template fingerprint -> (engine, image) a replica of that template runs.
    templates: dict[str, tuple[Any, str | None]] = field(default_factory=dict)
    replica_counts: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, VariantStatus] = field(default_factory=dict)
    #: variant -> why it waits (cache gate, start backoff, unschedulable).
    waiting: dict[str, str] = field(default_factory=dict)
    resolve_error: str | None = None
    restarts_total: int = 0
    starts_total: int = 0
    #: (node, revision) -> bytes fetched from the origin (warm-ups and cold starts).
    origin_bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: (node, revision) -> the last finished warm-up there (``runtime.warmup``).
    warmups: dict[tuple[str, str], WarmupRecord] = field(default_factory=dict)
    #: variant -> its ``model.fallback`` list, resolved (only once one is needed).
    fallbacks: dict[str, tuple[ResolvedVariant, ...]] = field(default_factory=dict)
    #: variant -> the planner's last ``Revoked`` message for it (status; Degraded).
    revoked: dict[str, str] = field(default_factory=dict)
    #: image ref -> the digests it resolved to (image manifest, index) as the image
    #: cache recorded them; kept once the image left the stores (revoked).
    image_digests: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: variant -> its ``image.fallback`` list, resolved: ``(ref, digests)``.
    image_fallbacks: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = field(
        default_factory=dict
    )
    #: What the last tick found revoked (revisions and image digests).
    revoked_keys: frozenset[str] = frozenset()

    def say(self, text: str) -> None:
        self.log.say(text)

    def rv(self, revision: str) -> ResolvedVariant:
        rv = self.known.get(revision)
        if rv is None:
            raise ControlError(f"revision {revision} is not one this endpoint resolved")
        return rv

    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise ControlError(
                f"no node {name!r}; nodes: {', '.join(self.nodes)} "
                "(add one with `preheat node add NAME`)"
            ) from None

    def is_target(self, node: Node) -> bool:
        w = self.spec.cache.weights
        return w.enabled and w.nodes.matches(node.spec.name, node.spec.label_map)

    def template(self, v: VariantSpec) -> str:
        """Fingerprint of how a replica runs (engine and image): part of the version."""
        text = json.dumps([type(v.engine).__name__, dataclasses.asdict(v.engine), v.image])
        tpl = hashlib.sha256(text.encode()).hexdigest()[:10]
        self.templates.setdefault(tpl, (v.engine, v.image))
        return tpl

    def live_replicas(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.phase is not ReplicaPhase.STOPPED]

    def ready_count(self, variant: str | None = None, revision: str | None = None) -> int:
        return sum(
            1
            for r in self.replicas.values()
            if r.phase is ReplicaPhase.READY
            and r.routed
            and (variant is None or r.variant == variant)
            and (revision is None or r.revision == revision)
        )
