"""The node agent (``preheat agent``): owns one node's store in Kubernetes mode.

One process per node (the rendered DaemonSet). It

1. watches ``ModelDataCache`` objects in every namespace and warms, with
   ``NodeStore.apull(source, revision=...)``, each revision whose target nodes include its
   node: one asyncio task per revision, at most ``max_warmups`` at once, retried with
   capped exponential back-off while the origin fails; the watch never waits for a fill;
2. writes the status of its ``NodeCache`` (cluster-scoped, named after the node; created
   when absent) only when the computed status differs from the stored one, and labels its
   Node ``preheat.dev/rev-<12 hex>: "true"`` per snapshot held (removed when it leaves);
3. watches the pods bound to its node (``fieldSelector=spec.nodeName=NODE``) and leases the
   snapshot named by a pod's ``preheat.dev/snapshot`` annotation for that pod (holder
   ``pod:<namespace>/<name>:<uid>``), releasing it once the pod is gone or finished; the
   store never evicts a leased snapshot;
4. serves ``/metrics`` (Prometheus) and ``/inventory`` (the local-mode JSON inventory);
5. keeps nothing that matters in memory: the store (blobs, snapshots, leases) is on disk,
   so a restarted agent re-lists, finds its revisions held, fetches nothing and writes no
   status when nothing changed.

Why the ``kubernetes`` client and not kopf: kopf is built for controllers that own the
objects they watch; it stores handler progress in annotations on them and adds
finalizers, which needs write access to ``ModelDataCache`` objects shared by every node's
agent (they would overwrite each other's progress) and that the agent role does not
grant. An agent only reads caches and pods, and reconciles a level-triggered view of both.
The blocking client runs its two watches in threads, which mark the view dirty; one
asyncio loop reconciles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Gauge

from preheat.artifacts.refs import redact_url
from preheat.errors import ConfigError, PreheatError
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_status import (
    SNAPSHOT_ANNOTATION,
    HeldRevision,
    WantedRevision,
    nodecache_status,
    revision_labels_patch,
    targets_node,
)
from preheat.store import NodeStore
from preheat.telemetry.inventory import WarmupFailure, inventory_from_store, inventory_to_json
from preheat.telemetry.prometheus import TelemetryMetrics

__all__ = ["AgentConfig", "NodeAgent", "api_client_from", "run_agent"]

log = logging.getLogger("preheat.agent")
_MERGE = "application/merge-patch+json"
_POD_HOLDER = "pod:"
#: freeBytes changes smaller than this (or 1 %) are not worth a status write.
_FREE_HYSTERESIS = 64 << 20


@dataclass(frozen=True)
class AgentConfig:
    """What ``preheat agent`` was asked to do."""

    node: str
    store: Path
    capacity: int | None = None
    port: int = 9101
    host: str = "127.0.0.1"
    max_warmups: int = 2
    resync_s: float = 10.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.node:
            raise ConfigError("--node is empty; pass the Node's name (the DaemonSet sets it)")
        if self.max_warmups < 1:
            raise ConfigError(f"max_warmups {self.max_warmups} must be >= 1")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ConfigError(
                f"back-off {self.backoff_s}..{self.backoff_max_s} s must satisfy 0 < min <= max"
            )


def api_client_from(kubeconfig: str | None) -> Any:
    """A ``kubernetes`` ApiClient: ``kubeconfig``, else ``$KUBECONFIG`` or ``~/.kube/config``,
    else the in-cluster ServiceAccount."""
    from kubernetes import client, config

    path = kubeconfig or os.environ.get("KUBECONFIG")
    default = Path.home() / ".kube" / "config"
    if path or default.is_file():
        return config.new_client_from_config(config_file=path or str(default))
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException as exc:
        raise ConfigError(
            f"no Kubernetes credentials: {exc}; pass --kubeconfig FILE or set KUBECONFIG"
        ) from exc
    return client.ApiClient(cfg)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _describe(exc: BaseException) -> str:
    """One redacted line for a failure (an ApiException's status and message, not its headers)."""
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    if status is not None and body:
        try:
            import json

            msg = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            msg = body
        return redact_url(f"API answered {status}: {msg}")
    return redact_url(f"{type(exc).__name__}: {exc}")


def _drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    if isinstance(d, list):
        return [_drop_none(v) for v in d]
    return d


@dataclass
class _Warm:
    """One revision being warmed (or retried)."""

    source: str
    revision: str | None
    state: str = "Filling"
    done: int = 0
    task: asyncio.Task[None] | None = None


@dataclass
class _View:
    """The watched objects (written by watch threads, read by the loop under ``lock``)."""

    caches: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, tuple[str, str | None, bool]] = field(default_factory=dict)  # holder -> ...
    pods_synced: bool = False
    caches_synced: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Metrics:
    def __init__(self) -> None:
        self.telemetry = TelemetryMetrics()
        r = self.telemetry.registry
        self.fetched = Counter(
            "preheat_agent_bytes_fetched", "Bytes the agent fetched from origins", registry=r
        )
        self.warmups = Counter(
            "preheat_agent_warmups", "Warm-up attempts by outcome", ["outcome"], registry=r
        )
        self.status_writes = Counter(
            "preheat_agent_status_writes", "NodeCache status writes", registry=r
        )
        self.api_errors = Counter(
            "preheat_agent_api_errors", "Kubernetes API calls that failed", ["op"], registry=r
        )
        self.reconciles = Counter(
            "preheat_agent_reconciles", "Reconcile passes completed", registry=r
        )
        self.leases = Gauge("preheat_agent_pod_leases", "Pod leases held", registry=r)


class NodeAgent:
    """The agent's state and loops; :meth:`run` until cancelled."""

    def __init__(self, cfg: AgentConfig, api_client: Any) -> None:
        from kubernetes import client

        self.cfg = cfg
        self.store = NodeStore(cfg.store, capacity=cfg.capacity)
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.view = _View()
        self.warms: dict[str, _Warm] = {}
        self.last_failure: WarmupFailure | None = None
        self.metrics = _Metrics()
        self._dirty = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem = asyncio.Semaphore(cfg.max_warmups)
        self._node_labels: dict[str, str] = {}
        self._written: dict[str, Any] | None = None
        #: source -> revision it resolved to, for caches that name no revision.
        self._resolved: dict[str, str] = {}
        self._stop = threading.Event()

    # --- watches (threads) --------------------------------------------------------------

    def _mark(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._dirty.set)

    def _watch(
        self, name: str, list_fn: Callable[..., Any], apply: Callable[..., None], **kw: Any
    ) -> None:
        """List then watch forever (re-list on any error or expiry), calling ``apply``."""
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                listed = list_fn(**kw)
                items, rv = self._items(listed)
                apply(None, items)
                self._mark()
                w = watch.Watch()
                for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=60, **kw):
                    if self._stop.is_set():
                        w.stop()
                        break
                    if ev["type"] == "ERROR":
                        break
                    apply(ev["type"], [ev["object"]])
                    self._mark()
            except Exception as exc:  # the API server restarts, a 410, a network blip
                self.metrics.api_errors.labels(f"watch-{name}").inc()
                log.warning("watch %s failed (%s); re-listing in 1 s", name, _describe(exc))
                self._stop.wait(1.0)

    @staticmethod
    def _items(listed: Any) -> tuple[list[Any], str]:
        if isinstance(listed, dict):
            return list(listed.get("items") or ()), listed["metadata"]["resourceVersion"]
        return list(listed.items), listed.metadata.resource_version

    def _apply_caches(self, kind: str | None, objs: list[dict[str, Any]]) -> None:
        with self.view.lock:
            if kind is None:
                self.view.caches = {}
                self.view.caches_synced = True
            for o in objs:
                key = f"{o['metadata']['namespace']}/{o['metadata']['name']}"
                if kind == "DELETED":
                    self.view.caches.pop(key, None)
                else:
                    self.view.caches[key] = o

    def _apply_pods(self, kind: str | None, objs: list[Any]) -> None:
        with self.view.lock:
            if kind is None:
                self.view.pods = {}
                self.view.pods_synced = True
            for p in objs:
                m = p.metadata
                holder = f"{_POD_HOLDER}{m.namespace}/{m.name}:{m.uid}"
                finished = (p.status.phase if p.status else None) in ("Succeeded", "Failed")
                if kind == "DELETED":
                    self.view.pods.pop(holder, None)
                else:
                    snap = (m.annotations or {}).get(SNAPSHOT_ANNOTATION)
                    self.view.pods[holder] = (m.name, snap, finished)

    def _start_watches(self) -> None:
        threads = [
            (
                "caches",
                self.custom.list_cluster_custom_object,
                self._apply_caches,
                {"group": GROUP, "version": VERSION, "plural": "modeldatacaches"},
            ),
            (
                "pods",
                self.core.list_pod_for_all_namespaces,
                self._apply_pods,
                {"field_selector": f"spec.nodeName={self.cfg.node}"},
            ),
        ]
        for name, fn, apply, kw in threads:
            threading.Thread(
                target=self._watch, args=(name, fn, apply), kwargs=kw, daemon=True, name=name
            ).start()

    # --- warming ------------------------------------------------------------------------

    def _targeting(self) -> list[dict[str, Any]]:
        """The specs of every ModelDataCache targeting this node."""
        with self.view.lock:
            caches = list(self.view.caches.values())
        specs = [o.get("spec") or {} for o in caches]
        return [
            s
            for s in specs
            if s.get("source") and targets_node(s, self.cfg.node, self._node_labels)
        ]

    def _wanted(self) -> dict[str, tuple[str, str | None]]:
        """key -> (source, revision) of every ModelDataCache targeting this node."""
        out: dict[str, tuple[str, str | None]] = {}
        for spec in self._targeting():
            rev = spec.get("revision") or None
            out[rev or spec["source"]] = (spec["source"], rev)
        return out

    def _apply_policies(self) -> None:
        """Pin a held snapshot while a targeting cache says ``pin``, give it the highest
        ``priority`` any of them asks for; a snapshot no cache wants is unpinned, priority 0
        (the agent owns the store in Kubernetes mode)."""
        pin: dict[str, bool] = {}
        prio: dict[str, int] = {}
        for spec in self._targeting():
            rev = spec.get("revision") or self._resolved.get(spec["source"])
            if rev is None:
                continue
            pin[rev] = pin.get(rev, False) or bool(spec.get("pin"))
            prio[rev] = max(prio.get(rev, 0), int(spec.get("priority") or 0))
        for info in self.store.snapshots():
            keys = [*info.revisions, info.digest]
            want_pin = any(pin.get(k, False) for k in keys)
            want_prio = max((prio.get(k, 0) for k in keys), default=0)
            if info.pinned != want_pin:
                (self.store.pin if want_pin else self.store.unpin)(info.digest)
            if info.priority != want_prio:
                self.store.set_priority(info.digest, want_prio)

    def _held(self, key: str) -> bool:
        try:
            return self.store.has(key)
        except PreheatError:
            return False

    def _ensure_warmups(self) -> None:
        with self.view.lock:
            if not self.view.caches_synced:
                return
        wanted = self._wanted()
        for key, (source, rev) in wanted.items():
            w = self.warms.get(key)
            if w is not None and (w.source, w.revision) == (source, rev):
                continue
            if w is not None and w.task is not None:
                w.task.cancel()
            resolved = rev or self._resolved.get(source)
            if resolved is not None and self._held(resolved):
                self.warms.pop(key, None)
                continue
            w = _Warm(source, rev)
            w.task = asyncio.create_task(self._warm(key, w), name=f"warm {key}")
            self.warms[key] = w
        for key in set(self.warms) - set(wanted):
            task = self.warms.pop(key).task
            if task is not None:
                task.cancel()

    async def _warm(self, key: str, w: _Warm) -> None:
        delay = self.cfg.backoff_s
        while True:
            try:
                async with self._sem:
                    w.state, w.done = "Filling", 0
                    self._dirty.set()

                    def progress(done: int, total: int) -> None:
                        w.done = done

                    res = await self.store.apull(w.source, revision=w.revision, progress=progress)
                self.metrics.fetched.inc(res.bytes_fetched)
                self._resolved[w.source] = res.revision
                self.metrics.warmups.labels("ok").inc()
                log.info(
                    "warmed %s: %d bytes fetched, %d reused",
                    res.revision,
                    res.bytes_fetched,
                    res.bytes_reused,
                )
                if self.warms.get(key) is w:
                    del self.warms[key]
                self._dirty.set()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is retried; the reason is reported
                self.metrics.warmups.labels("failed").inc()
                w.state = "Failed"
                reason = f"{type(exc).__name__}: {exc}"
                self.last_failure = WarmupFailure(w.revision or w.source, reason, time.time())
                log.warning("warm-up of %s failed, retry in %.1f s: %s",
                            redact_url(key), delay, self.last_failure.reason)  # fmt: skip
                self._dirty.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.backoff_max_s)

    # --- leases -------------------------------------------------------------------------

    def _reconcile_leases(self) -> None:
        with self.view.lock:
            if not self.view.pods_synced:
                return  # never release on a partial view
            pods = dict(self.view.pods)
        held: dict[str, set[str]] = {}
        for info in self.store.snapshots():
            for h in info.leases:
                held.setdefault(h, set()).add(info.digest)
        for holder, (_name, snap, finished) in pods.items():
            if snap and not finished and holder not in held and self._held(snap):
                self.store.lease(snap, holder)
                log.info("leased %s for %s", snap, holder)
        for holder in held:
            if holder.startswith(_POD_HOLDER) and (
                holder not in pods or pods[holder][2] or not pods[holder][1]
            ):
                self.store.release_holder(holder)
                log.info("released the lease of %s", holder)

    # --- status and labels --------------------------------------------------------------

    def _call(self, op: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except Exception:
            self.metrics.api_errors.labels(op).inc()
            raise

    def _nodecache(self) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        args = (GROUP, VERSION, "nodecaches", self.cfg.node)
        try:
            found: Any = self.custom.get_cluster_custom_object(*args)
            return dict(found)
        except ApiException as exc:
            if exc.status != 404:  # absent on first start: created below
                self.metrics.api_errors.labels("get-nodecache").inc()
                raise
        spec: dict[str, Any] = {"node": self.cfg.node, "storePath": str(self.store.root)}
        if self.cfg.capacity is not None:
            spec["capacityBytes"] = self.cfg.capacity
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "NodeCache",
            "metadata": {"name": self.cfg.node, "labels": {"app.kubernetes.io/part-of": "preheat"}},
            "spec": spec,
        }
        try:
            created = self._call(
                "create-nodecache", self.custom.create_cluster_custom_object,
                GROUP, VERSION, "nodecaches", body,
            )  # fmt: skip
            return dict(created)
        except ApiException as exc:
            if exc.status != 409:
                raise
            got: Any = self.custom.get_cluster_custom_object(*args)
            return dict(got)

    def _status(self, obj: dict[str, Any]) -> dict[str, Any]:
        infos = self.store.snapshots()
        held = [
            HeldRevision(
                manifest_digest=i.digest,
                revision=i.revisions[-1] if i.revisions else f"sha256:{i.digest}",
                source=i.refs[-1] if i.refs else None,
                size_bytes=i.size,
                pinned=i.pinned,
                leases=len(i.leases),
                last_used=_iso(i.last_use),
            )
            for i in infos
        ]
        pending = [
            WantedRevision(w.revision or redact_url(w.source), w.source, w.state, w.done)
            for w in self.warms.values()
        ]
        fail = self.last_failure
        return nodecache_status(
            generation=int(obj["metadata"].get("generation") or 1),
            now=_now(),
            capacity_bytes=self.cfg.capacity,
            free_bytes=self.store.free_bytes(),
            held=held,
            pending=pending,
            wanted=[redact_url(k) for k in self._wanted()],
            eviction_order=[c.digest for c in self.store.eviction_candidates()[:3]],
            last_failure=None
            if fail is None
            else {
                "time": _iso(fail.at),
                "reason": "WarmupFailed",
                "message": redact_url(f"{fail.revision}: {fail.reason}"),
            },
            previous=obj.get("status") or {},
        )

    def _write_status(self) -> bool:
        """Write the NodeCache status when it changed; returns whether it wrote."""
        with self.view.lock:
            if not self.view.caches_synced:
                return False  # what is wanted is unknown until the first list
        obj = self._nodecache()
        status = {k: _drop_none(v) for k, v in self._status(obj).items()}
        old_free = (obj.get("status") or {}).get("freeBytes")
        if isinstance(old_free, int) and abs(status["freeBytes"] - old_free) < max(
            _FREE_HYSTERESIS, old_free // 100
        ):
            status["freeBytes"] = old_free  # the disk's free space moves all the time
        if _drop_none(status) == _drop_none(obj.get("status") or {}):
            self._written = status
            return False
        self._call(
            "patch-nodecache-status",
            self.custom.patch_cluster_custom_object_status,
            GROUP, VERSION, "nodecaches", self.cfg.node, {"status": status},
            _content_type=_MERGE,
        )  # fmt: skip
        self.metrics.status_writes.inc()
        stored = obj.get("status") or {}
        changed = sorted(k for k, v in status.items() if _drop_none(stored.get(k)) != v)
        log.info("wrote NodeCache %s status (changed: %s)", self.cfg.node, ", ".join(changed))
        self._written = status
        return True

    def _refresh_node(self) -> None:
        node = self._call("get-node", self.core.read_node, self.cfg.node)
        self._node_labels = dict(node.metadata.labels or {})

    def _label_node(self) -> None:
        held = [i.digest for i in self.store.snapshots()]
        patch = revision_labels_patch(self._node_labels, held)
        if not patch:
            return
        self._call(
            "patch-node-labels", self.core.patch_node, self.cfg.node,
            {"metadata": {"labels": patch}}, _content_type=_MERGE,
        )  # fmt: skip
        for k, v in patch.items():
            if v is None:
                self._node_labels.pop(k, None)
            else:
                self._node_labels[k] = v

    # --- loop ---------------------------------------------------------------------------

    def inventory(self) -> str:
        """The local-mode inventory JSON of this node."""
        ready = {i.revisions[-1] if i.revisions else i.digest: True for i in self.store.snapshots()}
        inv = inventory_from_store(
            self.cfg.node,
            self.store,
            capacity_bytes=self.cfg.capacity,
            ready=ready,
            last_warmup_failure=self.last_failure,
        )
        self.metrics.telemetry.set_inventory([inv])
        self.metrics.leases.set(
            sum(1 for i in self.store.snapshots() for h in i.leases if h.startswith(_POD_HOLDER))
        )
        return inventory_to_json([inv])

    async def _reconcile(self) -> None:
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("node", self._refresh_node),
            ("leases", self._reconcile_leases),
            ("policies", self._apply_policies),
            ("labels", self._label_node),
            ("status", self._write_status),
        ]
        for name, step in steps:
            if name == "leases":
                self._ensure_warmups()
            try:
                await asyncio.to_thread(step)
            except Exception as exc:
                log.warning("reconcile step %s failed: %s", name, _describe(exc))
        self.metrics.reconciles.inc()

    async def run(self, ready: Callable[[str], None] | None = None) -> None:
        """Serve, watch and reconcile until cancelled; ``ready(url)`` once serving."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.store.clean_tmp)
        app = web.Application()

        async def metrics(_: web.Request) -> web.Response:
            await asyncio.to_thread(self.inventory)
            return web.Response(
                body=self.metrics.telemetry.exposition(),
                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
            )

        async def inventory(_: web.Request) -> web.Response:
            body = await asyncio.to_thread(self.inventory)
            return web.Response(text=body, content_type="application/json")

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/inventory", inventory)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
            await site.start()
            port = runner.addresses[0][1]
            self._start_watches()
            if ready is not None:
                ready(f"http://{self.cfg.host}:{port}")
            while True:
                self._dirty.clear()
                await self._reconcile()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), self.cfg.resync_s)
                await asyncio.sleep(0.2)  # coalesce bursts of events
        finally:
            self._stop.set()
            for w in self.warms.values():
                if w.task is not None:
                    w.task.cancel()
            await runner.cleanup()


def run_agent(cfg: AgentConfig, kubeconfig: str | None = None) -> None:
    """Run the agent until SIGINT/SIGTERM."""
    import signal

    agent = NodeAgent(cfg, api_client_from(kubeconfig))

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]

        def ready(url: str) -> None:
            print(f"preheat agent for node {cfg.node} serving {url}", flush=True)

        with contextlib.suppress(asyncio.CancelledError):
            await agent.run(ready)

    asyncio.run(main())
