"""Start records from pod objects: one ``StartRecord`` per engine pod start (pure: no I/O).

An engine pod (labels ``app.kubernetes.io/name: preheat``, ``app.kubernetes.io/component:
engine``, ``preheat.dev/endpoint``, ``preheat.dev/variant``; annotations
``preheat.dev/snapshot: <manifest digest>`` and ``preheat.dev/revision``) is read as
a local-mode replica start, stage by stage (``preheat.telemetry.records``):

=================  ===========================================================================
boundary           taken from (first start; ``restartCount`` 0)
=================  ===========================================================================
``scheduled``      ``metadata.creationTimestamp``: when the controller asked for the replica
                   (the scheduler's queue and binding count towards the next stage)
``image_ready``    the first container's ``startedAt`` (the first init container's, else the
                   engine's): the node had the image then. ``image_source`` is the caller's
                   ``image_held`` (``cache``: the node's agent held the engine image before the
                   pod was created, ``pull``: it did not; ``None``: unknown)
``weights_ready``  the last init container's ``finishedAt`` (on a cold node the init step
                   pulls from the origin); with no init container, the engine's ``startedAt``
``runtime_started`` the engine container's ``startedAt``, or the engine's own ``/startup``
                   time when given (sub-second)
``weights_loaded`` the engine's ``/startup`` only
``healthy``        the ``Ready`` condition's ``lastTransitionTime`` while it is ``True``
                   (when the Service starts routing to the pod)
``first_response`` ``None``: the recorder sends no request
=================  ===========================================================================

A container restart (``restartCount`` n > 0) is a start of its own: ``scheduled``,
``weights_ready`` and ``runtime_started`` are the running container's ``startedAt``,
``healthy`` the ``Ready`` transition after it; weights come from the node (``cache``), the
class is ``warm_restart``, ``restart_count`` is n.

Weights source: ``cache`` when the node's agent held the pod's snapshot when the weights
step began (``NodeSnapshot.held``, arrived no later than ``image_ready``; the arrival time
is the revision's ``readyAt`` in the NodeCache when the agent writes one), else ``origin``
(the init container pulled it). ``bytes_from`` is that source with the snapshot's bytes
(from the agent, else the engine's ``weights_bytes``).

Boundaries are clamped to be monotonic (API times have one-second resolution, the engine's
are sub-second): each is at least the previous one, ``weights_loaded`` at most ``healthy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from itertools import accumulate
from typing import Any, TypedDict

from preheat.artifacts.refs import redact_url
from preheat.runtime.kubernetes.nodecache_status import SNAPSHOT_ANNOTATION
from preheat.telemetry.classify import StartContext, StartReason, classify_start
from preheat.telemetry.records import StartRecord

__all__ = [
    "ENDPOINT_LABEL",
    "ENGINE_LABELS",
    "ENGINE_SELECTOR",
    "REVISION_ANNOTATION",
    "SNAPSHOT_ANNOTATION",
    "VARIANT_LABEL",
    "EngineStartup",
    "NodeSnapshot",
    "engine_container",
    "engine_startup_from_json",
    "node_snapshot_from_inventory",
    "node_snapshot_from_nodecache",
    "parse_time",
    "pod_failure",
    "pod_revision",
    "restart_count",
    "start_record_from_pod",
]

ENGINE_LABELS: Mapping[str, str] = {
    "app.kubernetes.io/name": "preheat",
    "app.kubernetes.io/component": "engine",
}
#: The label selector of every engine pod the operator creates.
ENGINE_SELECTOR = ",".join(f"{k}={v}" for k, v in ENGINE_LABELS.items())
ENDPOINT_LABEL = "preheat.dev/endpoint"
VARIANT_LABEL = "preheat.dev/variant"
REVISION_ANNOTATION = "preheat.dev/revision"
#: The container that runs the engine; else the pod's first container.
ENGINE_CONTAINER = "engine"


def parse_time(text: str | None) -> float | None:
    """An API timestamp (RFC 3339, ``Z`` or an offset, optional fraction) as epoch seconds."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(
            f"timestamp {text!r} is not RFC 3339 (e.g. 2026-12-01T12:59:31Z)"
        ) from None


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What the node's agent says about one snapshot: held or not, since when, how big.

    ``ready_at`` is the latest time it can have arrived (``None``: held since before anything
    the caller observed)."""

    held: bool
    ready_at: float | None = None
    size_bytes: int | None = None

    def held_at(self, t: float) -> bool:
        return self.held and (self.ready_at is None or self.ready_at <= t)


def _matches(entry_keys: set[str], snapshot: str | None, revision: str | None) -> bool:
    wanted = set()
    for key in (snapshot, revision):
        if key:
            wanted |= {key, key.removeprefix("sha256:"), "sha256:" + key.removeprefix("sha256:")}
    return bool(entry_keys & wanted)


def node_snapshot_from_nodecache(
    obj: Mapping[str, Any] | None, *, snapshot: str | None, revision: str | None
) -> NodeSnapshot:
    """From a ``NodeCache`` object: held when a ``Ready`` revision entry names the pod's
    revision or snapshot; ``ready_at`` is the ``Ready`` condition's transition time while it
    is ``True`` (every wanted revision was held by then)."""
    status = (obj or {}).get("status") or {}
    for entry in status.get("revisions") or ():
        if entry.get("state") != "Ready":
            continue
        if _matches({str(entry.get("revision"))}, snapshot, revision):
            ready: Mapping[str, Any] = next(
                (c for c in status.get("conditions") or () if c.get("type") == "Ready"), {}
            )
            at = (
                parse_time(ready.get("lastTransitionTime"))
                if ready.get("status") == "True"
                else None
            )
            if entry.get("readyAt"):  # the agent's own arrival time of this revision
                at = parse_time(entry["readyAt"])
            size = entry.get("bytes")
            return NodeSnapshot(True, at, int(size) if isinstance(size, int) else None)
    return NodeSnapshot(False)


def node_snapshot_from_inventory(
    inventory: Mapping[str, Any], node: str, *, snapshot: str | None, revision: str | None
) -> NodeSnapshot:
    """From an agent's ``/inventory`` JSON: held when a snapshot of ``node`` has the pod's
    manifest digest or revision (the inventory says nothing of when it arrived)."""
    for n in inventory.get("nodes") or ():
        if n.get("node") != node:
            continue
        for s in n.get("snapshots") or ():
            keys = {str(s.get("manifest_digest")), str(s.get("revision"))}
            if _matches(keys, snapshot, revision):
                return NodeSnapshot(True, None, int(s.get("size_bytes") or 0) or None)
    return NodeSnapshot(False)


@dataclass(frozen=True, slots=True)
class EngineStartup:
    """The engine's own start stages (``GET /startup``), epoch seconds."""

    runtime_started: float | None = None
    weights_loaded: float | None = None
    weights_bytes: int | None = None


def engine_startup_from_json(data: Any) -> EngineStartup:
    """Read ``/startup`` (``{"stages": {...}, "weights_bytes": n}``); unknown shapes give
    an empty ``EngineStartup``."""
    if not isinstance(data, Mapping):
        return EngineStartup()
    stages = data.get("stages", data)
    stages = stages if isinstance(stages, Mapping) else {}

    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    wb = data.get("weights_bytes")
    return EngineStartup(
        num(stages.get("runtime_started")),
        num(stages.get("weights_loaded")),
        int(wb) if isinstance(wb, int) and not isinstance(wb, bool) else None,
    )


def engine_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The engine container's status (named ``engine``, else the first); ``{}`` if none."""
    statuses = list((pod.get("status") or {}).get("containerStatuses") or ())
    named = [s for s in statuses if s.get("name") == ENGINE_CONTAINER]
    return (named or statuses or [{}])[0]


def restart_count(pod: Mapping[str, Any]) -> int:
    return int(engine_container(pod).get("restartCount") or 0)


def pod_revision(pod: Mapping[str, Any]) -> str:
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    return str(ann.get(REVISION_ANNOTATION) or ann.get(SNAPSHOT_ANNOTATION) or "unknown")


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for c in (pod.get("status") or {}).get("conditions") or ():
        if c.get("type") == kind:
            return dict(c)
    return {}


def _state_time(status: Mapping[str, Any], key: str) -> float | None:
    state = status.get("state") or {}
    for phase in ("running", "terminated"):
        if phase in state:
            return parse_time((state[phase] or {}).get(key))
    return None


def pod_failure(pod: Mapping[str, Any]) -> str | None:
    """Why the pod's current start failed (phase ``Failed``, or an init container that
    exited non-zero), or ``None`` while it is starting or running."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        why = status.get("message") or status.get("reason") or "pod phase Failed"
        return redact_url(f"pod failed: {why}")
    for c in status.get("initContainerStatuses") or ():
        term = (c.get("state") or {}).get("terminated") or {}
        if term and term.get("exitCode") not in (0, None) and int(c.get("restartCount") or 0) > 0:
            return redact_url(
                f"init container {c.get('name')} exited with code {term['exitCode']} "
                f"({c.get('restartCount')} restarts)"
            )
    return None


class _Boundaries(TypedDict):
    image_ready: float | None
    weights_ready: float | None
    runtime_started: float | None
    weights_loaded: float | None
    healthy: float | None


def _monotonic(scheduled: float, stamps: dict[str, float | None]) -> _Boundaries:
    """Each reached boundary at least the one before it; ``weights_loaded`` <= ``healthy``."""
    order = ("image_ready", "weights_ready", "runtime_started", "weights_loaded", "healthy")
    reached = [(n, stamps[n]) for n in order if stamps.get(n) is not None]
    floors = accumulate((float(v or 0) for _, v in reached), max, initial=scheduled)
    out: dict[str, float | None] = dict.fromkeys(order)
    out.update((name, floor) for (name, _), floor in zip(reached, list(floors)[1:], strict=True))
    if out["healthy"] is not None and (out["weights_loaded"] or 0) > out["healthy"]:
        out["weights_loaded"] = out["healthy"]
    return _Boundaries(
        image_ready=out["image_ready"], weights_ready=out["weights_ready"],
        runtime_started=out["runtime_started"], weights_loaded=out["weights_loaded"],
        healthy=out["healthy"],
    )  # fmt: skip


def start_record_from_pod(
    pod: Mapping[str, Any],
    *,
    node: NodeSnapshot | None,
    startup: EngineStartup | None = None,
    reason: StartReason = StartReason.INITIAL,
    node_is_new: bool = False,
    failure: str | None = None,
    image_held: bool | None = None,
) -> StartRecord | None:
    """The record of the pod's current start (see the module header), or ``None`` while it
    is still starting. ``failure`` (e.g. deleted before ready) forces a failed record.

    ``reason`` and ``node_is_new`` are what the controller knew (see
    ``podrecords_context``); a container restart is always ``restart`` on the same node."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    engine = engine_container(pod)
    restarts = int(engine.get("restartCount") or 0)
    ready = _condition(pod, "Ready")
    failure = failure or pod_failure(pod)
    started = _state_time(engine, "startedAt")
    healthy = parse_time(ready.get("lastTransitionTime")) if ready.get("status") == "True" else None
    if healthy is not None and started is not None and healthy < int(started):
        healthy = None  # a Ready from before this container started (still stale)
    if healthy is None and failure is None:
        return None
    inits = list(status.get("initContainerStatuses") or ())
    stamps: dict[str, float | None] = {}
    if restarts:
        scheduled = started if started is not None else parse_time(meta.get("creationTimestamp"))
        if scheduled is None:
            raise ValueError(f"pod {meta.get('name')!r} has no metadata.creationTimestamp")
        stamps["weights_ready"] = stamps["runtime_started"] = started
        ctx = StartContext(StartReason.RESTART, True, False, same_replica_on_node_before=True)
        weights_source = "cache"
    else:
        scheduled = parse_time(meta.get("creationTimestamp"))
        if scheduled is None:
            raise ValueError(f"pod {meta.get('name')!r} has no metadata.creationTimestamp")
        first = _state_time(inits[0], "startedAt") if inits else started
        stamps["image_ready"] = first
        done = [parse_time(((c.get("state") or {}).get("terminated") or {}).get("finishedAt"))
                for c in inits]  # fmt: skip
        stamps["weights_ready"] = done[-1] if inits and done[-1] is not None else started
        if not inits and started is None:
            stamps["weights_ready"] = None
        stamps["runtime_started"] = started
        held = node is not None and node.held_at(first if first is not None else scheduled)
        weights_source = "cache" if held else "origin"
        ctx = StartContext(reason, held, node_is_new, same_replica_on_node_before=False)
    if startup is not None:
        if startup.runtime_started is not None and started is not None:
            stamps["runtime_started"] = max(startup.runtime_started, started)
        stamps["weights_loaded"] = startup.weights_loaded
    if failure is None:
        stamps["healthy"] = healthy
    clean = _monotonic(scheduled, stamps)
    size = (node.size_bytes if node is not None else None) or (
        startup.weights_bytes if startup is not None else None
    )
    return StartRecord(
        endpoint=str(labels.get(ENDPOINT_LABEL) or meta.get("name") or "unknown"),
        variant=str(labels.get(VARIANT_LABEL) or "main"),
        replica=str(meta.get("name") or "unknown"),
        node=str(spec.get("nodeName") or "unscheduled"),
        revision=pod_revision(pod),
        event_class=classify_start(ctx),
        scheduled=scheduled,
        **clean,
        weights_source=weights_source,
        image_source=None
        if image_held is None or restarts
        else ("cache" if image_held else "pull"),
        bytes_from={weights_source: size} if size else {},
        restart_count=restarts,
        failure=None if failure is None else redact_url(failure),
    )
