# kopf types its handler protocols with every keyword; these take only what they use, and
# the kubernetes client marks every field Optional.
# mypy: disable-error-code="arg-type,union-attr"
"""``preheat operator``: kopf handlers around one reconcile loop per ``InferenceEndpoint``.

kopf (embedded with ``kopf.operator``, standalone: no peering objects) does the watching,
the per-object lifecycle and the finalizers; the behaviour is the shared planner's:

* a **daemon** per endpoint runs ``runtime.reconcile.ReconcileLoop`` over a
  :class:`~preheat.runtime.kubernetes.k8s_executor.KubeExecutor` (every ``--tick``
  seconds, and at once when a watched object changes);
* **event** handlers on the endpoint's pods, Deployments, NodeCaches and Nodes only wake
  the loops (level-triggered: the loop re-reads everything it plans on);
* **delete** handlers (kopf puts the finalizer ``preheat.dev/operator`` on the objects):
  an endpoint's Deployments, Services and caches are deleted (their owner references
  let the garbage collector do the same); a ``ModelDataCache`` is held until no pod runs
  its revision any more;
* Events through ``kopf.event``; handler progress in ``preheat.dev/`` annotations (not
  in ``status``, which the operator writes itself).

``/metrics`` (prometheus_client) on ``--metrics-port``: ``preheat_operator_*`` and any
registry added to :attr:`OperatorContext.registries`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import kopf
from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from preheat.runtime.fleetlog import FleetLog
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.image_caches import sync_image_caches
from preheat.runtime.kubernetes.k8s_executor import KubeExecutor, OperatorConfig
from preheat.runtime.kubernetes.revocations import sync_revocation_statuses
from preheat.runtime.kubernetes.workload import ENDPOINT_LABEL, REVISION_ANNOTATION
from preheat.runtime.reconcile import ReconcileLoop

__all__ = ["FINALIZER", "OperatorContext", "OperatorMetrics", "build_registry", "run_operator"]

log = logging.getLogger("preheat.operator")
FINALIZER = "preheat.dev/operator"


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.passes = Counter(
            "preheat_operator_reconciles", "Reconcile passes", ["namespace", "endpoint"],
            registry=registry,
        )  # fmt: skip
        self.actions = Counter(
            "preheat_operator_actions", "Planner actions carried out", ["action"],
            registry=registry,
        )  # fmt: skip
        self.errors = Counter(
            "preheat_operator_errors", "Unexpected errors in a pass", registry=registry
        )
        self.endpoints = Gauge(
            "preheat_operator_endpoints", "Endpoints with a running loop", registry=registry
        )


@dataclass
class OperatorContext:
    api: client.ApiClient
    config: OperatorConfig = field(default_factory=OperatorConfig)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    #: Served after the operator's own (other components' registries).
    registries: list[CollectorRegistry] = field(default_factory=list)
    loops: dict[tuple[str, str], ReconcileLoop] = field(default_factory=dict)
    metrics: OperatorMetrics | None = None

    def __post_init__(self) -> None:
        self.metrics = OperatorMetrics(self.registry)

    def wake(self, namespace: str | None = None, endpoint: str | None = None) -> None:
        for (ns, name), loop in self.loops.items():
            if (namespace is None or ns == namespace) and (endpoint is None or name == endpoint):
                loop.wake()

    def render_metrics(self) -> bytes:
        return b"".join(generate_latest(r) for r in [self.registry, *self.registries])


def _emit(body: dict[str, Any], kind: str, reason: str, message: str) -> None:
    kopf.event(body, type=kind, reason=reason, message=message[:1000])


class _CountingLoop(ReconcileLoop):
    def __init__(self, executor: KubeExecutor, ctx: OperatorContext, ns: str, name: str) -> None:
        super().__init__(executor, FleetLog(None), tick=ctx.config.tick_s)
        self._ctx, self._labels = ctx, (ns, name)

    async def once(self) -> None:
        before = self.log.errors
        await super().once()
        m = self._ctx.metrics
        assert m is not None
        m.passes.labels(*self._labels).inc()
        if self.log.errors > before:
            m.errors.inc(self.log.errors - before)


def build_registry(ctx: OperatorContext) -> kopf.OperatorRegistry:
    """Every handler of the operator, on a registry of its own (nothing global)."""
    reg = kopf.OperatorRegistry()
    endpoints = (GROUP, VERSION, "inferenceendpoints")
    caches = (GROUP, VERSION, "modeldatacaches")
    engine = {"app.kubernetes.io/name": "preheat", "app.kubernetes.io/component": "engine"}
    custom = client.CustomObjectsApi(ctx.api)
    core, apps = client.CoreV1Api(ctx.api), client.AppsV1Api(ctx.api)

    @kopf.on.startup(registry=reg)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix="preheat.dev"
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="preheat.dev", key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 60
        settings.watching.client_timeout = 70

    @kopf.on.login(registry=reg)
    def login(**kw: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_with_kubeconfig(**kw) or kopf.login_with_service_account(**kw)

    @kopf.daemon(*endpoints, registry=reg, cancellation_timeout=10)
    async def reconcile(name: str, namespace: str, stopped: kopf.DaemonStopped, **_: Any) -> None:
        executor = KubeExecutor(ctx.api, namespace, name, emit=_emit, config=ctx.config)
        executor.on_action = lambda kind: ctx.metrics.actions.labels(kind).inc()
        loop = _CountingLoop(executor, ctx, namespace, name)
        ctx.loops[(namespace, name)] = loop
        assert ctx.metrics is not None
        ctx.metrics.endpoints.set(len(ctx.loops))
        loop.start()
        try:
            await stopped.wait()
        finally:
            await loop.stop()
            ctx.loops.pop((namespace, name), None)
            ctx.metrics.endpoints.set(len(ctx.loops))

    @kopf.on.event(*endpoints, registry=reg)
    def endpoint_changed(name: str, namespace: str, **_: Any) -> None:
        ctx.wake(namespace, name)

    @kopf.on.event("v1", "pods", labels=engine, registry=reg)
    @kopf.on.event("apps", "v1", "deployments", labels=engine, registry=reg)
    def workload_changed(labels: dict[str, str], namespace: str, **_: Any) -> None:
        ctx.wake(namespace, labels.get(ENDPOINT_LABEL))

    @kopf.on.event(GROUP, VERSION, "nodecaches", registry=reg)
    @kopf.on.event(GROUP, VERSION, "revocations", registry=reg)
    @kopf.on.event("v1", "nodes", registry=reg)
    def nodes_changed(**_: Any) -> None:
        ctx.wake()

    # Each Revocation's status: which agents applied it (runtime.kubernetes.revocations).
    @kopf.timer(GROUP, VERSION, "revocations", interval=2.0, registry=reg)
    async def revocation_status(**_: Any) -> None:
        custom = client.CustomObjectsApi(ctx.api)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await asyncio.to_thread(sync_revocation_statuses, custom, now)

    @kopf.on.delete(*endpoints, registry=reg)
    async def endpoint_deleted(name: str, namespace: str, logger: Any, **_: Any) -> None:
        # Stop the endpoint's reconcile loop first (kopf may still be running it): a pass
        # that observed the endpoint before its deletion would otherwise re-list it in a
        # shared ModelImageCache, or re-create a Deployment, after this handler cleaned up.
        running = ctx.loops.get((namespace, name))
        if running is not None:
            await running.stop()
        sel = f"{ENDPOINT_LABEL}={name}"
        for d in (
            await asyncio.to_thread(apps.list_namespaced_deployment, namespace, label_selector=sel)
        ).items:
            await _delete(apps.delete_namespaced_deployment, d.metadata.name, namespace)
        for s in (
            await asyncio.to_thread(core.list_namespaced_service, namespace, label_selector=sel)
        ).items:
            await _delete(core.delete_namespaced_service, s.metadata.name, namespace)
        listed: Any = await asyncio.to_thread(
            custom.list_namespaced_custom_object, *caches[:2], namespace, caches[2],
            label_selector=sel,
        )  # fmt: skip
        for c in listed.get("items") or ():
            await _delete(custom.delete_namespaced_custom_object, *caches[:2], namespace,
                          caches[2], c["metadata"]["name"])  # fmt: skip
        await sync_image_caches(custom, namespace, name, None)  # leaves the shared image caches
        logger.info(f"endpoint {namespace}/{name}: Deployments, Services and caches deleted")

    @kopf.on.delete(*caches, registry=reg)
    async def cache_deleted(
        spec: dict[str, Any], namespace: str, labels: dict[str, str], **_: Any
    ) -> None:
        sel = f"{ENDPOINT_LABEL}={labels.get(ENDPOINT_LABEL, '')}"
        pods = await asyncio.to_thread(core.list_namespaced_pod, namespace, label_selector=sel)
        using = [
            p.metadata.name
            for p in pods.items
            if (p.metadata.annotations or {}).get(REVISION_ANNOTATION) == spec.get("revision")
        ]
        if using:
            raise kopf.TemporaryError(
                f"revision {str(spec.get('revision'))[:12]} still runs in "
                f"{', '.join(str(u) for u in using)}",
                delay=2,
            )

    return reg


async def _delete(fn: Any, *args: Any) -> None:
    # Unparsed: a Service delete answers a Status object that the client cannot turn
    # into a Service, and kopf would retry the whole deletion a minute later.
    try:
        # raw answer: a 1.20 API server answers a Service delete with a Status, which the
        # client fails to read as a V1Service (the handler then waited 60 s to retry)
        resp = await asyncio.to_thread(
            fn, *args, propagation_policy="Background", _preload_content=False
        )
        resp.release_conn()
    except ApiException as exc:
        if exc.status != 404:
            raise


async def _serve_metrics(ctx: OperatorContext, host: str, port: int) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=ctx.render_metrics(), content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", metrics)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    log.info("operator metrics on http://%s:%s/metrics", host, bound)
    print(f"preheat operator: metrics on http://{host}:{bound}/metrics", flush=True)
    return runner


async def run_operator(
    ctx: OperatorContext,
    *,
    namespace: str | None,
    kubeconfig: str | None,
    metrics_host: str,
    metrics_port: int,
) -> None:
    """Serve /metrics and run kopf until SIGINT/SIGTERM."""
    if kubeconfig:
        os.environ["KUBECONFIG"] = kubeconfig  # kopf's login_with_kubeconfig reads it
    # Every engine pod start becomes a StartRecord with local mode's stages and classes,
    # exported on the operator's /metrics beside its own series (podrecords.py).
    from preheat.runtime.kubernetes.podrecords import PodStartRecorder

    recorder = PodStartRecorder(ctx.api, namespace, probe_engines=True)
    ctx.registries.append(recorder.registry)
    recorder.start()
    runner = await _serve_metrics(ctx, metrics_host, metrics_port)
    try:
        await kopf.operator(
            registry=build_registry(ctx),
            standalone=True,
            clusterwide=namespace is None,
            namespaces=[namespace] if namespace else (),
        )
    finally:
        recorder.stop()
        await runner.cleanup()
