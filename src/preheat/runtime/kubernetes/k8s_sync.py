"""The Kubernetes executor's writes of the variant's workload and of status: each
variant's Deployment (its effective version, desired count, and whether its cold pods
pull from peers: the ``peers.enabled`` of ConfigMap ``preheat-settings`` in the system
namespace, ``$PREHEAT_SYSTEM_NAMESPACE``, default ``preheat-system``; no ConfigMap, or
none readable: peers off) and Service, and after each
pass (``commit``) the endpoint's and its caches' status, an Event per condition
transition and the ``ModelImageCache`` objects."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from kubernetes.client.exceptions import ApiException

from preheat.control.rollout import effective_version
from preheat.control.state import revision_of, template_of
from preheat.runtime.kubernetes import endpoint_status as es
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.discovery_slices import variant_service_name
from preheat.runtime.kubernetes.image_caches import sync_image_caches
from preheat.runtime.kubernetes.k8s_executor_base import (
    _CACHES,
    _ENDPOINTS,
    _MERGE,
    ExecutorBase,
    _compact,
    _iso,
    _short,
)
from preheat.runtime.kubernetes.revocations import running_variant
from preheat.runtime.kubernetes.workload import (
    SPEC_REPLICAS_ANNOTATION,
    VERSION_ANNOTATION,
    deployment_body,
    service_body,
)

__all__ = ["SETTINGS_TTL_S", "WorkloadSync"]

log = logging.getLogger("preheat.operator")
#: Seconds the operator keeps its reading of the cluster's peer settings.
SETTINGS_TTL_S = 10.0


class WorkloadSync(ExecutorBase):
    """``_sync`` and ``commit`` for :class:`~preheat.runtime.kubernetes.k8s_executor.KubeExecutor`."""

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
        res = self._resolved_rev(rev)
        # The image fallback the planner moved the variant to (its own image revoked).
        spec_v = running_variant(p.spec.variant(variant), template_of(target))
        if res is None:
            res = es.Resolved(spec_v.model.source, rev, mem.digests.get(rev, rev), 0)
        mem.digests[rev] = res.digest
        body = deployment_body(
            p.endpoint, p.spec, spec_v, name=name, revision=rev, digest=res.digest,
            source=res.source, replicas=dv.replicas, pod=p.pod, max_surge=p.desired.max_surge,
            progress_deadline_s=self.config.rollout_deadline_s, spec_replicas=spec_v.replicas.min,
            peers=await self._peers_on(),
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

    async def _peers_on(self) -> bool:
        """Whether the cluster runs peers (module docstring), read at most every
        :data:`SETTINGS_TTL_S` seconds; a settings file that does not parse: off, logged."""
        from preheat.errors import ConfigError
        from preheat.runtime.kubernetes.agent_peers_config import (
            SETTINGS_CONFIGMAP,
            SETTINGS_KEY,
            parse_settings,
        )

        now = self.clock()
        cached: tuple[float, bool] | None = getattr(self, "_peers_read", None)
        if cached is not None and now - cached[0] < SETTINGS_TTL_S:
            return cached[1]
        ns = os.environ.get("PREHEAT_SYSTEM_NAMESPACE") or "preheat-system"
        try:
            cm = await self._call(self.core.read_namespaced_config_map, SETTINGS_CONFIGMAP, ns)
            on = parse_settings((cm.data or {}).get(SETTINGS_KEY)).enabled
        except ApiException as exc:
            if exc.status not in (403, 404):
                raise
            on = False  # no agents with peers installed, or no grant to read them
        except ConfigError as exc:
            log.warning("peers off for new pods: %s", exc)
            on = False
        self._peers_read = (now, on)
        return on

    async def _ensure_service(self, variant: str, name: str) -> None:
        p = self.p
        assert p.spec is not None and p.endpoint is not None
        if name in getattr(self, "_services", set()):
            return
        body = service_body(p.endpoint, p.spec, variant, name)
        try:
            await self._call(self.core.create_namespaced_service, self.namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            await self._update_service_ports(name, body["spec"]["ports"])
        self._services = getattr(self, "_services", set()) | {name}

    async def _update_service_ports(self, name: str, ports: list[dict[str, Any]]) -> None:
        """A Service made before its engine published KV events (or stopped) gets the
        ports it should have (by name): the router's discovery reads them."""
        svc = await self._call(self.core.read_namespaced_service, name, self.namespace)
        have = [(p.name, p.port) for p in svc.spec.ports or ()]
        if have != [(q["name"], q["port"]) for q in ports]:
            await self._call(
                self.core.patch_namespaced_service, name, self.namespace,
                {"spec": {"ports": ports}}, _content_type=_MERGE,
            )  # fmt: skip
            log.info("service %s/%s ports now %s", self.namespace, name,
                     [q["name"] for q in ports])  # fmt: skip

    # --- after each pass --------------------------------------------------------------

    async def commit(self) -> None:
        """Write the endpoint's and its caches' status; one Event per transition; then the
        ``ModelImageCache`` objects (``image_caches``: never before the Deployment)."""
        p = self.p
        if p.endpoint is None:
            return
        await self._commit_status()
        if p.spec is not None and not p.endpoint["metadata"].get("deletionTimestamp"):
            # an unreadable spec keeps what it had; a deleted endpoint's handler leaves
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
            revoked=dict(p.revoked),
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
