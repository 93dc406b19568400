"""The Kubernetes executor's observe step: the endpoint, Nodes, NodeCaches (written by
the agents), the endpoint's pods, Deployments and ModelDataCaches, read once per pass
into a ``_Pass`` and turned into the planner's ``Desired`` and ``Observed``; the sources
resolved once per endpoint generation."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from preheat.control.revocation import substitute
from preheat.control.spec_types import EndpointSpec
from preheat.control.state import (
    CacheView,
    Desired,
    DesiredVariant,
    NodeView,
    Observed,
    ReplicaView,
    WeightsPolicy,
    revision_of,
)
from preheat.errors import PreheatError
from preheat.runtime.kubernetes import endpoint_status as es
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.discovery_slices import variant_service_name
from preheat.runtime.kubernetes.k8s_executor_base import _CACHES, _ENDPOINTS, ExecutorBase, _Pass
from preheat.runtime.kubernetes.resources import endpoint_from_object
from preheat.runtime.kubernetes.revocations import list_revocations, resolve_fallbacks
from preheat.runtime.kubernetes.workload import (
    REVISION_ANNOTATION,
    VERSION_ANNOTATION,
    replica_count,
    template_fingerprint,
)
from preheat.runtime.nodestore import open_source
from preheat.sources.completion import complete_manifest

__all__ = ["FAILED_RESTARTS", "Observer"]

#: A pod restarted this often without becoming ready counts as failed (rollback input).
FAILED_RESTARTS = 3


def _epoch(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _node_up(node: dict[str, Any]) -> bool:
    if node.get("spec", {}).get("unschedulable") or node["metadata"].get("deletionTimestamp"):
        return False
    conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions") or ()}
    return conds.get("Ready") == "True"


class Observer(ExecutorBase):
    """``observe`` for :class:`~preheat.runtime.kubernetes.k8s_executor.KubeExecutor`."""

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
        desired = self._desired(p.spec)
        p.observed = self._observed(p)
        revoked = await self._revoked(p.spec, ep)
        if revoked:
            desired = self._desired(p.spec)  # now with the fallbacks resolved
            p.observed = dataclasses.replace(p.observed, revoked=revoked)
        # What the Deployments and status follow: the planner's view after revocations.
        p.desired = substitute(desired, p.observed).desired
        return desired, p.observed

    async def _revoked(self, spec: EndpointSpec, ep: dict[str, Any]) -> frozenset[str]:
        """Revisions of this endpoint on the cluster's revocation list; resolves the
        spec's fallbacks (once per generation) when the current revision is one."""
        keys = await asyncio.to_thread(list_revocations, self.custom)
        if not keys:
            return frozenset()
        fallbacks = [r for fbs in self.fallbacks.values() for r in fbs]
        known = [*self.resolved.values(), *fallbacks]
        revoked = await self.images.revoked_revisions(keys, known, self.notices)
        generation = ep["metadata"].get("generation", 0)
        current = {r.revision for r in self.resolved.values()}
        if revoked & current and self.fallbacks_generation != generation:
            self.fallbacks, problems = await resolve_fallbacks(spec)
            self.fallbacks_generation = generation
            self.notices.extend(problems)
            fallbacks = [r for fbs in self.fallbacks.values() for r in fbs]
            known = [*self.resolved.values(), *fallbacks]
            revoked = await self.images.revoked_revisions(keys, known, self.notices)
        images, problems = await self.images.revoked(spec, keys)
        self.notices.extend(p for p in problems if p not in self.notices)
        return revoked | images

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
                # the digest names the snapshot before any node holds it (hf:// git files)
                manifest = await complete_manifest(src, res)
            except PreheatError as exc:
                self.p.problem = ("SourceUnreachable", f"variant {v.name}: {exc}")
                return False
            finally:
                await src.aclose()
            if v.model.revision and v.model.revision not in (res.revision, manifest.digest):
                self.p.problem = (
                    "RevisionMismatch",
                    f"variant {v.name}: spec.model.revision {v.model.revision!r} does not match "
                    f"what the source resolves to ({res.revision}); fix the revision or source",
                )
                return False
            out[v.name] = es.Resolved(
                v.model.source, res.revision, manifest.digest, manifest.total_size
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
                fallbacks=tuple((r.revision, r.bytes) for r in self.fallbacks.get(v.name, ())),
                image=self.images.variant(v)[0],
                image_fallbacks=self.images.variant(v)[1],
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
            # The agent retries a failed fill itself; the operator never re-creates. A
            # fill that failed for room other copies hold (``NoRoom``) lets the planner
            # give it a superseded copy's room (``control.plan`` step 6).
            out[r["revision"]] = CacheView(
                state,  # type: ignore[arg-type]
                reason=str(r.get("reason") or ""),
                retry_at=float("inf"),
                short_of_room=state == "failed" and r.get("reason") == "NoRoom",
            )
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
