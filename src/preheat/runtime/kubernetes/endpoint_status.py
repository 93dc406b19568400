"""The status the operator writes: ``InferenceEndpoint`` and ``ModelDataCache`` (pure).

Built from one reconcile pass's view (:class:`EndpointView`) and the previous status, so
conditions keep their ``lastTransitionTime`` while they hold. The executor's memory that
must survive an operator restart (:class:`VariantMemory`: stable version, failed
versions, latched gates, when a gate began waiting; the resolved revisions) is written
into ``status.variants`` and read back by :func:`memory_from_status`.

Conditions, with the reasons a user sees in ``kubectl describe``:

=========== =============================================================================
Ready       ``AllReplicasReady`` / ``ReplicasNotReady``, ``WaitingForCache``, a problem
CacheReady  ``TargetNodesWarm`` / ``WaitingForNodes``, ``GateTimedOut``; ``CacheDisabled``
Progressing ``RollingToFallback``, ``WaitingForCache``, ``RollingOut``, ``ScalingUp`` /
            ``Stable``
Degraded    ``Revoked`` (no allowed fallback), ``RolloutFailed``, ``Unschedulable``,
            ``InvalidSpec``, ``SourceUnreachable``, ``RevisionMismatch`` / ``AsExpected``
=========== =============================================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from preheat.control.rollout import effective_version
from preheat.control.spec_types import EndpointSpec
from preheat.control.state import (
    Desired,
    NodeView,
    OpenGate,
    ReplicaView,
    VariantStatus,
    WaitGate,
    revision_of,
)
from preheat.runtime.kubernetes.conditions import Condition, merge_conditions, transitions
from preheat.runtime.kubernetes.nodecache_status import targets_node

__all__ = [
    "EndpointView",
    "Resolved",
    "VariantMemory",
    "cache_status",
    "endpoint_status",
    "is_bad",
    "memory_from_status",
    "resolved_from_status",
    "transitions",
]


@dataclass(frozen=True)
class Resolved:
    source: str
    revision: str
    digest: str
    bytes: int


@dataclass
class VariantMemory:
    stable: str | None = None
    failed: set[str] = field(default_factory=set)
    gates_open: set[str] = field(default_factory=set)
    gate_since: dict[str, float] = field(default_factory=dict)
    rollback_reason: str = ""
    digests: dict[str, str] = field(default_factory=dict)

    def status(self) -> VariantStatus:
        return VariantStatus(
            stable=self.stable,
            failed=frozenset(self.failed),
            gate_open=frozenset(self.gates_open),
            gate_since=tuple(sorted(self.gate_since.items())),
        )


def memory_from_status(status: Mapping[str, Any]) -> dict[str, VariantMemory]:
    out = {}
    for v in status.get("variants") or ():
        out[v["name"]] = VariantMemory(
            stable=v.get("stable") or None,
            failed=set(v.get("failedVersions") or ()),
            gates_open=set(v.get("gatesOpen") or ()),
            gate_since={g["revision"]: float(g["since"]) for g in v.get("gateSince") or ()},
        )
    return out


def resolved_from_status(
    status: Mapping[str, Any], sources: Mapping[str, str]
) -> dict[str, Resolved]:
    """The revisions resolved for the status' generation (sources from the spec: a source
    may carry a credential, so status never holds one)."""
    out = {}
    for v in status.get("variants") or ():
        if v.get("revision") and v.get("digest") and v["name"] in sources:
            out[v["name"]] = Resolved(
                sources[v["name"]], v["revision"], v["digest"], v.get("bytes", 0)
            )
    return out


@dataclass(frozen=True)
class EndpointView:
    generation: int
    spec: EndpointSpec | None
    resolved: Mapping[str, Resolved]
    resolved_generation: int
    memory: Mapping[str, VariantMemory]
    nodes: Sequence[NodeView]
    replicas: Sequence[ReplicaView]
    desired: Desired | None
    deployments: Mapping[str, Any]
    gates: Mapping[str, WaitGate | OpenGate]
    unschedulable: Mapping[str, str]
    notices: Sequence[str] = ()
    problem: tuple[str, str] | None = None
    #: variant -> (fallback revision or None, message), from the planner's ``Revoked``.
    revoked: Mapping[str, tuple[str | None, str]] = field(default_factory=dict)


def is_bad(c: Mapping[str, Any]) -> bool:
    """A condition a user should notice (for the Event type)."""
    if c["type"] == "Degraded":
        return bool(c["status"] == "True")
    return (
        c["status"] == "False"
        and c["type"] in ("Ready", "CacheReady")
        and c["reason"] not in ("ReplicasNotReady",)
    )


def _short(rev: str) -> str:
    return rev.removeprefix("sha256:")[:12]


def endpoint_status(view: EndpointView, old: Mapping[str, Any], *, now: str) -> dict[str, Any]:
    """The endpoint's new ``status`` (see the module docstring)."""
    out: dict[str, Any] = {k: v for k, v in old.items() if k != "conditions"}
    conds: list[Condition] = []
    if view.problem is not None or view.spec is None or view.desired is None:
        reason, message = view.problem or ("Unknown", "not reconciled yet")
        conds += [
            Condition("Ready", False, reason, message),
            Condition("Degraded", True, reason, message),
        ]
        out["message"] = message
        out["observedGeneration"] = view.generation
        out["conditions"] = merge_conditions(
            old.get("conditions"), conds, generation=view.generation, now=now
        )
        return out
    w = view.spec.cache.weights
    variants, cache_bad, not_ready, progressing, degraded = [], [], [], [], []
    total = ready_total = ready_target = 0
    first_rev, first_warm = "", 0
    for dv in view.desired.variants:
        mem = view.memory.get(dv.name) or VariantMemory()
        target = effective_version(dv.version, mem.status())
        rev = revision_of(target)
        mine = [r for r in view.replicas if r.variant == dv.name]
        ready = [r for r in mine if r.phase == "ready"]
        ready_new = [r for r in ready if r.version == target]
        old_live = [r for r in mine if r.version != target and r.phase in ("starting", "ready")]
        targets = [n for n in view.nodes if n.up and n.target]
        warm = sum(1 for n in targets if n.holds(rev))
        needed = w.min_ready if w.min_ready is not None else len(targets)
        gate = view.gates.get(dv.name)
        if not first_rev:
            first_rev, first_warm = rev, warm
        if w.enabled:
            if isinstance(gate, WaitGate):
                waiting = ", ".join(gate.waiting_on) or "no target node"
                cache_bad.append(
                    (
                        "WaitingForNodes",
                        f"{dv.name}: {gate.ready} of {gate.needed} target nodes "
                        f"hold {_short(rev)}; waiting on {waiting}",
                    )
                )
                progressing.append(
                    ("WaitingForCache", f"{dv.name}: no pods until the cache gate opens")
                )
                not_ready.append(("WaitingForCache", f"{dv.name}: waiting for the model cache"))
            elif warm < needed:
                cache_bad.append(
                    (
                        "GateTimedOut" if rev in mem.gates_open else "WaitingForNodes",
                        f"{dv.name}: only {warm} of {needed} target nodes hold {_short(rev)} after "
                        f"{w.timeout_seconds:g} s; deployed anyway (cold nodes pull from the origin)",
                    )
                )
        if len(ready_new) < dv.replicas and not isinstance(gate, WaitGate):
            not_ready.append(
                ("ReplicasNotReady", f"{dv.name}: {len(ready_new)}/{dv.replicas} ready")
            )
            if old_live:
                progressing.append(("RollingOut", f"{dv.name}: rolling to {_short(rev)}"))
            else:
                progressing.append(
                    ("ScalingUp", f"{dv.name}: {len(ready_new)}/{dv.replicas} ready")
                )
        elif old_live:
            progressing.append(("RollingOut", f"{dv.name}: draining {len(old_live)} old pods"))
        if dv.version in mem.failed:
            degraded.append(("RolloutFailed", f"{dv.name}: {mem.rollback_reason or 'rollout failed'}; "
                             f"serving {_short(rev)}"))  # fmt: skip
        if dv.name in view.unschedulable:
            degraded.append(("Unschedulable", f"{dv.name}: {view.unschedulable[dv.name]}"))
        if dv.name in view.revoked:
            to, message = view.revoked[dv.name]
            if to is None:
                degraded.append(("Revoked", message))
            elif old_live or len(ready_new) < dv.replicas:
                progressing.insert(0, ("RollingToFallback", message))
        total += dv.replicas
        ready_total += len(ready)
        ready_target += min(len(ready_new), dv.replicas)
        res = view.resolved.get(dv.name)
        variants.append(
            {
                "name": dv.name,
                "revision": rev,
                "digest": mem.digests.get(rev) or (res.digest if res else ""),
                "bytes": res.bytes if res else 0,
                "replicas": dv.replicas,
                "readyReplicas": len(ready_new),
                "warmNodes": warm,
                "stable": mem.stable or "",
                "failedVersions": sorted(mem.failed),
                "gatesOpen": sorted(mem.gates_open),
                "gateSince": [
                    {"revision": k, "since": v} for k, v in sorted(mem.gate_since.items())
                ],
            }
        )
    if not w.enabled:
        conds.append(Condition("CacheReady", True, "CacheDisabled",
                               "modelCacheConfig.weights is off; pods pull from the origin"))  # fmt: skip
    elif cache_bad:
        conds.append(
            Condition("CacheReady", False, cache_bad[0][0], "; ".join(m for _, m in cache_bad))
        )
    else:
        conds.append(Condition("CacheReady", True, "TargetNodesWarm",
                               f"{first_warm} target nodes hold {_short(first_rev)}"))  # fmt: skip
    if not_ready:
        conds.append(Condition("Ready", False, not_ready[0][0], "; ".join(m for _, m in not_ready)))
    else:
        conds.append(Condition("Ready", True, "AllReplicasReady", f"{ready_target}/{total} ready"))
    if progressing:
        conds.append(
            Condition("Progressing", True, progressing[0][0], "; ".join(m for _, m in progressing))
        )
    else:
        conds.append(Condition("Progressing", False, "Stable", "every variant runs its version"))
    if degraded:
        conds.append(Condition("Degraded", True, degraded[0][0], "; ".join(m for _, m in degraded)))
    else:
        conds.append(Condition("Degraded", False, "AsExpected", "no failure"))
    out.update(
        {
            "observedGeneration": view.generation,
            "resolvedGeneration": view.resolved_generation,
            "revision": first_rev,
            "replicas": total,
            "readyReplicas": ready_total,
            "warmNodes": first_warm,
            "variants": variants,
            "message": view.notices[-1]
            if view.notices
            else "; ".join(c.message for c in conds if c.type == "Progressing" and c.status),
        }
    )
    out["conditions"] = merge_conditions(
        old.get("conditions"), conds, generation=view.generation, now=now
    )
    return out


def cache_status(
    cache: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    nodecaches: Mapping[str, Mapping[str, Any]],
    old: Mapping[str, Any],
    *,
    now: str,
) -> dict[str, Any]:
    """A ``ModelDataCache``'s status aggregated from the agents' ``NodeCache`` status."""
    spec = cache.get("spec") or {}
    rev = spec.get("revision") or ""
    states, targets, failures = [], [], []
    size = 0
    for node in nodes:
        meta = node["metadata"]
        name = meta["name"]
        if not targets_node(spec, name, meta.get("labels") or {}):
            continue
        targets.append(name)
        nc = (nodecaches.get(name) or {}).get("status") or {}
        entry = next((r for r in nc.get("revisions") or () if r.get("revision") == rev), None)
        state = (entry or {}).get("state") or "Pending"
        item: dict[str, Any] = {
            "name": name,
            "state": state,
            "bytes": int((entry or {}).get("bytes") or 0),
        }
        if state == "Ready":
            size = max(size, item["bytes"])
        if state == "Failed":
            msg = ((nc.get("lastFailure") or {}).get("message")) or "warm-up failed"
            item["message"] = msg
            failures.append(f"{name}: {msg}")
        prev = next((n for n in old.get("nodes") or () if n.get("name") == name), None)
        item["lastTransitionTime"] = (
            prev["lastTransitionTime"]
            if prev and prev.get("state") == state and prev.get("lastTransitionTime")
            else now
        )
        states.append(item)
    ready = sum(1 for s in states if s["state"] == "Ready")
    min_ready = spec.get("minReady")
    needed = int(min_ready) if min_ready is not None else len(targets)
    busy = [s["name"] for s in states if s["state"] in ("Pending", "Filling")]
    gen = int((cache.get("metadata") or {}).get("generation") or 0)
    conds = [
        Condition("CacheReady", ready >= needed,
                  "MinReadyNodesHold" if ready >= needed else "WaitingForNodes",
                  f"{ready} of {len(targets)} target nodes hold {_short(rev)} (minReady {needed})"),
        Condition("Ready", ready == len(targets) and bool(targets),
                  "AllTargetsHold" if ready == len(targets) and targets else "NotAllTargetsHold",
                  f"{ready}/{len(targets)} target nodes hold it"),
        Condition("Progressing", bool(busy), "Filling" if busy else "Idle",
                  f"filling on {', '.join(busy)}" if busy else "no fill running"),
        Condition("Degraded", bool(failures), "WarmupFailed" if failures else "AsExpected",
                  "; ".join(failures) if failures else "no failure"),
    ]  # fmt: skip
    return {
        "observedGeneration": gen,
        "bytes": size,
        "targetNodes": targets,
        "readyNodes": ready,
        "nodes": states,
        "conditions": merge_conditions(old.get("conditions"), conds, generation=gen, now=now),
    }
