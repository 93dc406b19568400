"""The Kubernetes executor: the reconcile loop's ``Executor`` over API objects.

One instance per ``InferenceEndpoint``, driven by ``runtime.reconcile.ReconcileLoop``
(observe -> ``control.plan`` -> execute), like local mode's executor. ``observe`` reads
the endpoint, Nodes, NodeCaches (written by the agents), the endpoint's pods,
Deployments and ModelDataCaches, and turns them into the planner's ``Desired`` and
``Observed``; the actions become objects:

================  ===================================================================
action            Kubernetes
================  ===================================================================
Warm              the revision's ``ModelDataCache`` exists (the node agents fill it)
WaitGate          no Deployment for the revision yet; ``CacheReady=False`` says why
OpenGate          the gate is latched open in ``status.variants[].gatesOpen``
StartReplica      the variant's Deployment runs the target version with the desired
                  count (the scheduler places pods; affinity prefers warm nodes)
Drain             the Deployment converges (its rolling update drains old pods)
StopReplica       a pod on a lost node (or a failed one) is deleted at once, so its
                  ReplicaSet replaces it on a live node
AddRoute          nothing: the router follows the variant Service's EndpointSlices
FinishRollout     ``stable`` in status; the old cache is no longer wanted
Rollback          the version is marked failed; the Deployment goes back to stable
DeleteRevision    the unwanted revision's ``ModelDataCache`` is deleted (its finalizer
                  holds it until no pod runs that revision)
Notice            status message + Event
(after a pass)    ``ModelImageCache`` per image with ``modelCacheConfig.image.enabled``
                  (``image_caches``; never gates the Deployment)
================  ===================================================================

A cache is one object for all nodes, so per-node cache views come from the agents'
``NodeCache`` status (and their Node labels). The executor's memory between passes
(stable version, failed versions, latched gates, when a gate began waiting, the resolved
revisions) lives in the endpoint's status, so a restarted operator carries on.
``commit`` (after each pass) writes the endpoint's and its caches' status and posts an
Event per condition transition.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preheat.control.rollout import effective_version
from preheat.control.spec_types import EndpointSpec
from preheat.control.state import (
    AddRoute,
    CacheView,
    DeleteRevision,
    Desired,
    DesiredVariant,
    Drain,
    FinishRollout,
    NodeView,
    Notice,
    Observed,
    OpenGate,
    ReplicaView,
    Rollback,
    StartReplica,
    StopReplica,
    Unschedulable,
    WaitGate,
    Warm,
    WeightsPolicy,
    revision_of,
)
from preheat.errors import PreheatError
from preheat.runtime.kubernetes import endpoint_status as es
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.discovery import variant_service_name
from preheat.runtime.kubernetes.image_caches import sync_image_caches
from preheat.runtime.kubernetes.resources import endpoint_from_object
from preheat.runtime.kubernetes.workload import (
    ENDPOINT_LABEL,
    REVISION_ANNOTATION,
    SPEC_REPLICAS_ANNOTATION,
    VERSION_ANNOTATION,
    cache_body,
    cache_name,
    deployment_body,
    replica_count,
    service_body,
    template_fingerprint,
)
from preheat.runtime.nodestore import open_source

__all__ = ["EmitFn", "KubeExecutor", "OperatorConfig"]

log = logging.getLogger("preheat.operator")

#: (object body, "Normal" | "Warning", reason, message) -> posts a Kubernetes Event.
EmitFn = Callable[[dict[str, Any], str, str, str], None]

_CACHES = "modeldatacaches"
_MERGE = "application/merge-patch+json"
_ENDPOINTS = "inferenceendpoints"
#: A pod restarted this often without becoming ready counts as failed (rollback input).
FAILED_RESTARTS = 3


@dataclass(frozen=True)
class OperatorConfig:
    rollout_deadline_s: int = 600
    tick_s: float = 2.0


@dataclass
class _Pass:
    """What one pass learned, for ``commit``."""

    endpoint: dict[str, Any] | None = None
    spec: EndpointSpec | None = None
    pod: dict[str, Any] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    nodecaches: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)
    desired: Desired | None = None
    observed: Observed | None = None
    gates: dict[str, WaitGate | OpenGate] = field(default_factory=dict)
    unschedulable: dict[str, str] = field(default_factory=dict)
    problem: tuple[str, str] | None = None  # (reason, message) that stops planning


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _short(revision: str) -> str:
    return revision.removeprefix("sha256:")[:12]


def _compact(obj: Any) -> Any:
    """Without empty strings and ``None`` (the 1.20 test API server stores an empty string
    as null and then refuses the object: "must be of type string")."""
    if isinstance(obj, dict):
        return {k: _compact(v) for k, v in obj.items() if v is not None and v != ""}
    if isinstance(obj, list):
        return [_compact(v) for v in obj]
    return obj


def _node_up(node: dict[str, Any]) -> bool:
    if node.get("spec", {}).get("unschedulable") or node["metadata"].get("deletionTimestamp"):
        return False
    conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions") or ()}
    return conds.get("Ready") == "True"


class KubeExecutor:
    """Executor for one endpoint (see the module docstring)."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        *,
        emit: EmitFn,
        config: OperatorConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.namespace, self.name = namespace, name
        self.emit = emit
        self.config = config or OperatorConfig()
        self.clock = clock
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.memory: dict[str, es.VariantMemory] = {}
        self.resolved: dict[str, es.Resolved] = {}
        self.resolved_generation = -1
        self.notices: list[str] = []
        self.p = _Pass()
        self.actions: dict[str, int] = {}
        #: Called with each action's type name (the operator's metrics).
        self.on_action: Callable[[str], None] = lambda _kind: None

    # --- API helpers ------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(fn, *a, **kw)

    async def _list(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> list[dict[str, Any]]:
        out = await self._call(fn, *a, _preload_content=False, **kw)
        return list(json.loads(out.data).get("items") or ())

    def _selector(self) -> str:
        return f"{ENDPOINT_LABEL}={self.name}"

    # --- observe ----------------------------------------------------------------------

    async def observe(self) -> tuple[Desired, Observed] | None:
        self.p = p = _Pass()
        self.notices = []
        try:
            ep = await self._call(
                self.custom.get_namespaced_custom_object,
                GROUP, VERSION, self.namespace, _ENDPOINTS, self.name,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        if ep["metadata"].get("deletionTimestamp"):
            return None
        p.endpoint = ep
        try:
            p.spec, pod = endpoint_from_object(ep)
        except PreheatError as exc:
            p.problem = ("InvalidSpec", str(exc))
            return None
        p.pod = pod.to_dict()
        self._remember(ep, p.spec)
        if not await self._resolve(p.spec, ep):
            return None
        sel = self._selector()
        ns = self.namespace
        (
            p.nodes, ncs, p.pods, deps, caches
        ) = await asyncio.gather(
            self._list(self.core.list_node),
            self._list(self.custom.list_cluster_custom_object, GROUP, VERSION, "nodecaches"),
            self._list(self.core.list_namespaced_pod, ns, label_selector=sel),
            self._list(self.apps.list_namespaced_deployment, ns, label_selector=sel),
            self._list(
                self.custom.list_namespaced_custom_object, GROUP, VERSION, ns, _CACHES,
                label_selector=sel,
            ),
        )  # fmt: skip
        p.nodecaches = {(o.get("spec") or {}).get("node") or o["metadata"]["name"]: o for o in ncs}
        p.deployments = {d["metadata"]["name"]: d for d in deps}
        for c in caches:  # list items carry no kind; Events need it
            c.setdefault("apiVersion", f"{GROUP}/{VERSION}")
            c.setdefault("kind", "ModelDataCache")
        p.caches = {c["metadata"]["name"]: c for c in caches}
        p.desired = self._desired(p.spec)
        p.observed = self._observed(p)
        return p.desired, p.observed

    def _remember(self, ep: dict[str, Any], spec: EndpointSpec) -> None:
        """Load the executor's memory from status on the first pass (operator restart)."""
        if self.memory:
            return
        status = ep.get("status") or {}
        self.memory = es.memory_from_status(status)
        if status.get("resolvedGeneration") == ep["metadata"].get("generation"):
            sources = {v.name: v.model.source for v in spec.variants}
            self.resolved = es.resolved_from_status(status, sources)
            if self.resolved:
                self.resolved_generation = ep["metadata"]["generation"]

    async def _resolve(self, spec: EndpointSpec, ep: dict[str, Any]) -> bool:
        generation = ep["metadata"].get("generation", 0)
        if generation == self.resolved_generation and set(self.resolved) >= {
            v.name for v in spec.variants
        }:
            return True
        out: dict[str, es.Resolved] = {}
        for v in spec.variants:
            src = open_source(v.model.source)
            try:
                res = await src.resolve()
            except PreheatError as exc:
                self.p.problem = ("SourceUnreachable", f"variant {v.name}: {exc}")
                return False
            finally:
                await src.aclose()
            if v.model.revision and v.model.revision not in (res.revision, res.manifest.digest):
                self.p.problem = (
                    "RevisionMismatch",
                    f"variant {v.name}: spec.model.revision {v.model.revision!r} does not match "
                    f"what the source resolves to ({res.revision}); fix the revision or source",
                )
                return False
            out[v.name] = es.Resolved(
                v.model.source, res.revision, res.manifest.digest, res.manifest.total_size
            )
        self.resolved, self.resolved_generation = out, generation
        return True

    def _desired(self, spec: EndpointSpec) -> Desired:
        w = spec.cache.weights
        variants = tuple(
            DesiredVariant(
                v.name,
                self.resolved[v.name].revision,
                self.resolved[v.name].bytes,
                # Never fight an HPA or `kubectl scale` (workload.replica_count).
                replica_count(
                    v.replicas.min,
                    self.p.deployments.get(variant_service_name(self.name, v.name)),
                    autoscaled=spec.autoscaling is not None,
                ),
                v.weight,
                template=template_fingerprint(v),
            )
            for v in spec.variants
        )
        policy = WeightsPolicy(w.enabled, w.min_ready, w.timeout_seconds, w.pin, w.priority)
        return Desired(spec.name, variants, policy, max_surge=1)

    def _held(self, p: _Pass, node: dict[str, Any]) -> dict[str, CacheView]:
        """revision -> cache view on this node, from its NodeCache status and labels."""
        name = node["metadata"]["name"]
        status = (p.nodecaches.get(name) or {}).get("status") or {}
        out: dict[str, CacheView] = {}
        for r in status.get("revisions") or ():
            state = {"Ready": "ready", "Filling": "warming", "Failed": "failed"}.get(
                r.get("state", ""), "warming"
            )
            # The agent retries a failed fill itself; the operator never re-creates.
            out[r["revision"]] = CacheView(state, reason="", retry_at=float("inf"))  # type: ignore[arg-type]
        return out

    def _observed(self, p: _Pass) -> Observed:
        assert p.spec is not None
        now = self.clock()
        w = p.spec.cache.weights
        wanted = {r.revision for r in self.resolved.values()}
        cached: set[str] = {
            str(c["spec"]["revision"])
            for c in p.caches.values()
            if (c.get("spec") or {}).get("revision")
        }
        nodes = []
        for node in p.nodes:
            meta = node["metadata"]
            name, labels = meta["name"], meta.get("labels") or {}
            target = w.nodes.matches(name, labels)
            held = self._held(p, node)
            views: list[tuple[str, CacheView]] = []
            for rev in sorted(wanted | cached):
                view = held.get(rev)
                if view is None:
                    exists = any(
                        (c.get("spec") or {}).get("revision") == rev for c in p.caches.values()
                    )
                    view = CacheView("warming" if exists and target else "absent")
                if rev not in wanted:
                    # An unwanted revision's cache object: "ready" lets the planner say
                    # DeleteRevision once no replica uses it.
                    view = CacheView("ready")
                views.append((rev, view))
            nodes.append(
                NodeView(name, _node_up(node), slots=1000, target=target, cache=tuple(views))
            )
        replicas = []
        for seq, pod in enumerate(sorted(p.pods, key=lambda o: o["metadata"]["creationTimestamp"])):
            r = self._replica(pod, seq, now)
            if r is not None:
                replicas.append(r)
        statuses = tuple(
            (v.name, self.memory.get(v.name, es.VariantMemory()).status()) for v in p.spec.variants
        )
        return Observed(now, tuple(nodes), tuple(replicas), statuses)

    def _replica(self, pod: dict[str, Any], seq: int, now: float) -> ReplicaView | None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node:
            return None  # not scheduled yet: the Deployment owns it, nothing to plan
        ann = meta.get("annotations") or {}
        version = ann.get(VERSION_ANNOTATION) or ann.get(REVISION_ANNOTATION, "")
        status = pod.get("status") or {}
        conds = {c["type"]: c["status"] for c in status.get("conditions") or ()}
        restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or ())
        age = now - _epoch(meta.get("creationTimestamp"))
        if meta.get("deletionTimestamp"):
            phase = "draining"
        elif conds.get("Ready") == "True":
            phase = "ready"
        elif (
            status.get("phase") == "Failed"
            or restarts >= FAILED_RESTARTS
            or age > self.config.rollout_deadline_s
        ):
            phase = "failed"
        else:
            phase = "starting"
        rev = revision_of(version)
        return ReplicaView(
            meta["name"],
            (meta.get("labels") or {}).get("preheat.dev/variant", ""),
            rev,
            node,
            phase,  # type: ignore[arg-type]
            routed=phase == "ready",
            seq=seq,
            template=version[len(rev) + 1 :],
        )

    # --- actions ----------------------------------------------------------------------

    def _count(self, action: object) -> None:
        kind = type(action).__name__
        self.actions[kind] = self.actions.get(kind, 0) + 1
        self.on_action(kind)

    def _mem(self, variant: str) -> es.VariantMemory:
        return self.memory.setdefault(variant, es.VariantMemory())

    async def warm(self, action: Warm, /) -> None:
        self._count(action)
        p = self.p
        assert p.spec is not None and p.endpoint is not None
        name = cache_name(self.name, action.revision)
        if name in p.caches:
            return
        src = next(r.source for r in self.resolved.values() if r.revision == action.revision)
        body = cache_body(p.endpoint, p.spec, action.revision, src)
        try:
            created = await self._call(
                self.custom.create_namespaced_custom_object,
                GROUP, VERSION, self.namespace, _CACHES, body,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
            return
        p.caches[name] = created
        self.emit(p.endpoint, "Normal", "CacheCreated",
                  f"ModelDataCache {name} for revision {_short(action.revision)} "
                  f"({p.spec.cache.weights.nodes.describe()})")  # fmt: skip

    async def wait_gate(self, action: WaitGate, /) -> None:
        self._count(action)
        mem = self._mem(action.variant)
        if action.revision not in mem.gate_since:
            mem.gate_since[action.revision] = self.clock()
        self.p.gates[action.variant] = action

    async def open_gate(self, action: OpenGate, /) -> None:
        self._count(action)
        mem = self._mem(action.variant)
        mem.gates_open.add(action.revision)
        self.p.gates[action.variant] = action
        if self.p.endpoint is not None:
            if action.timed_out:
                self.emit(self.p.endpoint, "Warning", "CacheGateTimedOut",
                          f"{action.variant}: only {action.ready} of {action.needed} target nodes "
                          f"hold {_short(action.revision)}; deploying anyway (cold nodes pull from "
                          "the origin)")  # fmt: skip
            else:
                self.emit(self.p.endpoint, "Normal", "CacheReady",
                          f"{action.variant}: {action.ready} of {action.needed} target nodes hold "
                          f"{_short(action.revision)}; deploying")  # fmt: skip

    async def start_replica(self, action: StartReplica, /) -> None:
        self._count(action)
        await self._sync(action.variant)

    async def unschedulable(self, action: Unschedulable, /) -> None:
        self._count(action)
        self.p.unschedulable[action.variant] = f"{action.missing} replicas: {action.reason}"

    async def add_route(self, action: AddRoute, /) -> None:
        self._count(action)  # the router follows the Service's EndpointSlices

    async def drain(self, action: Drain, /) -> None:
        self._count(action)
        variant = self._variant_of(action.replica)
        if variant:
            await self._sync(variant)

    async def stop_replica(self, action: StopReplica, /) -> None:
        self._count(action)
        variant = self._variant_of(action.replica)
        try:
            await self._call(
                self.core.delete_namespaced_pod, action.replica, self.namespace,
                grace_period_seconds=0,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise
        if self.p.endpoint is not None:
            self.emit(self.p.endpoint, "Warning", "PodReplaced",
                      f"pod {action.replica} deleted ({action.reason}); its ReplicaSet "
                      "replaces it")  # fmt: skip
        if variant:
            await self._sync(variant)

    async def finish_rollout(self, action: FinishRollout, /) -> None:
        self._count(action)
        mem = self._mem(action.variant)
        if mem.stable == action.revision:
            return
        mem.stable = action.revision
        if self.p.endpoint is not None and action.previous is not None:
            self.emit(self.p.endpoint, "Normal", "RolloutFinished",
                      f"{action.variant}: every pod runs {_short(revision_of(action.revision))} "
                      f"(was {_short(revision_of(action.previous))})")  # fmt: skip

    async def rollback(self, action: Rollback, /) -> None:
        self._count(action)
        mem = self._mem(action.variant)
        mem.failed.add(action.revision)
        mem.stable = mem.stable or action.to
        mem.rollback_reason = action.reason
        if self.p.endpoint is not None:
            self.emit(self.p.endpoint, "Warning", "RolledBack",
                      f"{action.variant}: {action.reason}; back to "
                      f"{_short(revision_of(action.to))}")  # fmt: skip
        await self._sync(action.variant)

    async def delete_revision(self, action: DeleteRevision, /) -> None:
        self._count(action)
        name = cache_name(self.name, action.revision)
        cache = self.p.caches.get(name)
        if cache is None or cache["metadata"].get("deletionTimestamp"):
            return
        replicas = self.p.observed.replicas if self.p.observed else ()
        if any(r.revision == action.revision for r in replicas):
            return
        try:
            await self._call(
                self.custom.delete_namespaced_custom_object,
                GROUP, VERSION, self.namespace, _CACHES, name,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise
        cache["metadata"]["deletionTimestamp"] = _iso(self.clock())
        if self.p.endpoint is not None:
            self.emit(self.p.endpoint, "Normal", "CacheDeleted",
                      f"ModelDataCache {name}: revision {_short(action.revision)} is no longer "
                      "wanted (rollout finished)")  # fmt: skip

    async def notice(self, action: Notice, /) -> None:
        self._count(action)
        self.notices.append(action.text)

    # --- the variant's Deployment and Service -----------------------------------------

    def _variant_of(self, pod_name: str) -> str | None:
        for pod in self.p.pods:
            if pod["metadata"]["name"] == pod_name:
                return (pod["metadata"].get("labels") or {}).get("preheat.dev/variant")
        return None

    async def _sync(self, variant: str) -> None:
        """The variant's Deployment runs its effective version (only one whose cache gate
        is open) with the desired count; its Service exists."""
        p = self.p
        assert p.spec is not None and p.endpoint is not None and p.desired is not None
        dv = next(v for v in p.desired.variants if v.name == variant)
        mem = self._mem(variant)
        target = effective_version(dv.version, mem.status())
        rev = revision_of(target)
        name = variant_service_name(self.name, variant)
        current = p.deployments.get(name)
        gate_ok = not p.desired.weights.enabled or rev in mem.gates_open
        if not gate_ok:
            if current is None:
                return
            cur_version = current["spec"]["template"]["metadata"]["annotations"][VERSION_ANNOTATION]
            target = cur_version
            rev = revision_of(target)
        res = next((r for r in self.resolved.values() if r.revision == rev), None)
        spec_v = p.spec.variant(variant)
        if res is None:
            res = es.Resolved(spec_v.model.source, rev, mem.digests.get(rev, rev), 0)
        mem.digests[rev] = res.digest
        body = deployment_body(
            p.endpoint, p.spec, spec_v, name=name, revision=rev, digest=res.digest,
            source=res.source, replicas=dv.replicas, pod=p.pod, max_surge=p.desired.max_surge,
            progress_deadline_s=self.config.rollout_deadline_s, spec_replicas=spec_v.replicas.min,
        )  # fmt: skip
        # The template of the version being rolled back to keeps its own fingerprint.
        body["spec"]["template"]["metadata"]["annotations"][VERSION_ANNOTATION] = target
        await self._ensure_service(variant, name)
        if current is None:
            created = await self._call(self.apps.create_namespaced_deployment, self.namespace, body)
            p.deployments[name] = created.to_dict() if hasattr(created, "to_dict") else created
            self.emit(p.endpoint, "Normal", "DeploymentCreated",
                      f"Deployment {name}: {dv.replicas} replicas of {_short(rev)}")  # fmt: skip
            return
        cur = current["spec"]
        cur_version = cur["template"]["metadata"].get("annotations", {}).get(VERSION_ANNOTATION)
        applied = (current["metadata"].get("annotations") or {}).get(SPEC_REPLICAS_ANNOTATION)
        spec_count = body["metadata"]["annotations"][SPEC_REPLICAS_ANNOTATION]
        if cur_version == target and cur.get("replicas") == dv.replicas and applied == spec_count:
            return
        patch = {
            "metadata": {"annotations": {SPEC_REPLICAS_ANNOTATION: spec_count}},
            "spec": {"replicas": dv.replicas, "template": body["spec"]["template"]},
        }
        await self._call(
            self.apps.patch_namespaced_deployment, name, self.namespace, patch,
            _content_type=_MERGE,
        )  # fmt: skip
        current["spec"]["replicas"] = dv.replicas
        current["metadata"].setdefault("annotations", {})[SPEC_REPLICAS_ANNOTATION] = spec_count
        current["spec"]["template"] = body["spec"]["template"]
        if cur_version != target:
            self.emit(p.endpoint, "Normal", "RolloutStarted",
                      f"Deployment {name}: rolling to {_short(rev)} (surge 1, none unavailable)")  # fmt: skip

    async def _ensure_service(self, variant: str, name: str) -> None:
        p = self.p
        assert p.spec is not None and p.endpoint is not None
        if name in getattr(self, "_services", set()):
            return
        try:
            await self._call(
                self.core.create_namespaced_service,
                self.namespace, service_body(p.endpoint, p.spec, variant, name),
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._services = getattr(self, "_services", set()) | {name}

    # --- after each pass --------------------------------------------------------------

    async def commit(self) -> None:
        """Write the endpoint's and its caches' status; one Event per transition; then the
        ``ModelImageCache`` objects (``image_caches``: never before the Deployment)."""
        p = self.p
        if p.endpoint is None:
            return
        await self._commit_status()
        if p.spec is not None:  # an unreadable spec keeps what it had
            await sync_image_caches(self.custom, self.namespace, self.name, p.spec, self._emit_obj)

    def _emit_obj(self, obj: dict[str, Any], reason: str, message: str) -> None:
        obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelImageCache", **obj}
        self.emit(obj, "Normal", reason, message)

    async def _commit_status(self) -> None:
        p = self.p
        assert p.endpoint is not None
        now = self.clock()
        view = es.EndpointView(
            generation=p.endpoint["metadata"].get("generation", 0),
            spec=p.spec,
            resolved=dict(self.resolved),
            resolved_generation=self.resolved_generation,
            memory=self.memory,
            nodes=p.observed.nodes if p.observed else (),
            replicas=p.observed.replicas if p.observed else (),
            desired=p.desired,
            deployments=p.deployments,
            gates={k: v for k, v in p.gates.items()},
            unschedulable=dict(p.unschedulable),
            notices=tuple(self.notices),
            problem=p.problem,
        )
        old = p.endpoint.get("status") or {}
        new = _compact(es.endpoint_status(view, old, now=_iso(now)))
        if new != old:
            log.debug("endpoint status %s", json.dumps(new))
            try:
                await self._call(
                    self.custom.patch_namespaced_custom_object_status,
                    GROUP, VERSION, self.namespace, _ENDPOINTS, self.name, {"status": new},
                    _content_type=_MERGE,
                )  # fmt: skip
            except ApiException:
                log.error("status patch refused: %s", json.dumps(new))
                raise
            for c in es.transitions(old.get("conditions"), new["conditions"]):
                kind = "Warning" if es.is_bad(c) else "Normal"
                self.emit(
                    p.endpoint, kind, f"{c['type']}{c['status']}", f"{c['reason']}: {c['message']}"
                )
            p.endpoint["status"] = new
        for cache in p.caches.values():
            if cache["metadata"].get("deletionTimestamp"):
                continue
            old_c = cache.get("status") or {}
            new_c = _compact(es.cache_status(cache, p.nodes, p.nodecaches, old_c, now=_iso(now)))
            if new_c != old_c:
                await self._call(
                    self.custom.patch_namespaced_custom_object_status,
                    GROUP, VERSION, self.namespace, _CACHES, cache["metadata"]["name"],
                    {"status": new_c},
                    _content_type=_MERGE,
                )  # fmt: skip
                for c in es.transitions(old_c.get("conditions"), new_c["conditions"]):
                    if c["type"] == "CacheReady":
                        self.emit(cache, "Normal" if c["status"] == "True" else "Warning",
                                  f"CacheReady{c['status']}", c["message"])  # fmt: skip
