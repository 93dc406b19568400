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
DeleteRevision    the unwanted revision's ``ModelDataCache`` is deleted once no pod runs
                  that revision; while it is kept for a rollback (stable) and pods
                  elsewhere run it, the node is added to its ``spec.nodes.exclude``
                  (the node's agent unpins the copy and lets eviction take it)
Notice            status message + Event
Revoked           ``Degraded=True Revoked`` (no fallback) or ``Progressing=True
                  RollingToFallback``, and a ``Revoked`` Event (``revocations``)
(after a pass)    ``ModelImageCache`` per image with ``modelCacheConfig.image.enabled``
                  (``image_caches``; never gates the Deployment)
================  ===================================================================

A cache is one object for all nodes, so per-node cache views come from the agents'
``NodeCache`` status (and their Node labels). The executor's memory between passes
(stable version, failed versions, latched gates, when a gate began waiting, the resolved
revisions) lives in the endpoint's status, so a restarted operator carries on.
``commit`` (after each pass) writes the endpoint's and its caches' status and posts an
Event per condition transition.

The parts: :mod:`.k8s_observe` (``observe``), this module (one handler per action),
:mod:`.k8s_sync` (the variant's Deployment and Service, ``commit``), on the shared state
and API helpers of :mod:`.k8s_executor_base`.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from preheat.control.state import (
    AddRoute,
    DeleteRevision,
    Drain,
    FinishRollout,
    Notice,
    OpenGate,
    Revoked,
    Rollback,
    StartReplica,
    StopReplica,
    Unschedulable,
    WaitGate,
    Warm,
    revision_of,
)
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.k8s_executor_base import (
    _CACHES,
    _MERGE,
    EmitFn,
    OperatorConfig,
    _iso,
    _short,
)
from preheat.runtime.kubernetes.k8s_observe import Observer
from preheat.runtime.kubernetes.k8s_sync import WorkloadSync
from preheat.runtime.kubernetes.nodecache_status import targets_node
from preheat.runtime.kubernetes.workload import cache_body, cache_name

__all__ = ["EmitFn", "KubeExecutor", "OperatorConfig"]


class KubeExecutor(Observer, WorkloadSync):
    """Executor for one endpoint (see the module docstring): ``observe`` (:mod:`.k8s_observe`),
    one handler per action (here), the variant's Deployment and ``commit``
    (:mod:`.k8s_sync`)."""

    async def warm(self, action: Warm, /) -> None:
        self._count(action)
        p = self.p
        assert p.spec is not None and p.endpoint is not None
        name = cache_name(self.name, action.revision)
        if name in p.caches:
            return
        res = self._resolved_rev(action.revision)
        assert res is not None, action.revision
        body = cache_body(p.endpoint, p.spec, action.revision, res.source)
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
            # Kept for a rollback (a variant's stable revision) but not on this node: let
            # it go here only. After the rollout the whole cache goes once no pod runs it.
            kept = {revision_of(m.stable) for m in self.memory.values() if m.stable}
            if action.revision in kept:
                await self._release_node(cache, name, action)
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

    async def _release_node(self, cache: dict[str, Any], name: str, action: DeleteRevision) -> None:
        """Pods elsewhere still run the revision: take only ``action.node`` out of the
        cache's targets (``spec.nodes.exclude``), so that node's agent stops keeping it."""
        nodes = dict(cache["spec"].get("nodes") or {})
        excluded = list(nodes.get("exclude") or ())
        if action.node in excluded:
            return
        node = next((n for n in self.p.nodes if n["metadata"]["name"] == action.node), None)
        labels = (node or {}).get("metadata", {}).get("labels") or {}
        if node is None or not targets_node(cache["spec"], action.node, labels):
            return  # the node does not keep it: nothing to release
        nodes["exclude"] = sorted({*excluded, action.node})
        patched = await self._call(
            self.custom.patch_namespaced_custom_object,
            GROUP, VERSION, self.namespace, _CACHES, name, {"spec": {"nodes": nodes}},
            _content_type=_MERGE,
        )  # fmt: skip
        self.p.caches[name] = patched
        if self.p.endpoint is not None:
            self.emit(self.p.endpoint, "Normal", "CacheReleased",
                      f"ModelDataCache {name}: revision {_short(action.revision)} is no longer "
                      f"kept on {action.node} (no pod there runs it)")  # fmt: skip

    async def notice(self, action: Notice, /) -> None:
        self._count(action)
        self.notices.append(action.text)

    async def revoked(self, action: Revoked, /) -> None:
        self._count(action)
        p = self.p
        p.revoked[action.variant] = (action.to, action.message)
        if self.revoked_said.get(action.variant) != action.message and p.endpoint is not None:
            self.revoked_said[action.variant] = action.message
            self.emit(p.endpoint, "Warning", "Revoked", action.message)
