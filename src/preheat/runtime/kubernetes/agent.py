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
asyncio loop reconciles. While it waits it also looks at the store's ``snapshots/`` every
0.5 s (:mod:`.agent_store_watch`), so a copy evicted behind its back (another process,
``preheat cache evict``, ``verify``) leaves the status within about a second.

This module holds the watches and the loop; the agent owns one collaborator per concern:
:mod:`.agent_warmups` (fills, pins, priorities), :mod:`.agent_leases` (pod leases),
:mod:`.agent_status` (NodeCache status and Node labels, bodies from the pure
:mod:`.nodecache_body` and :mod:`.nodecache_status`); :mod:`.agent_config` (config, API
client) and :mod:`.agent_metrics` (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from preheat.runtime.kubernetes.agent_config import AgentConfig, api_client_from, describe_error
from preheat.runtime.kubernetes.agent_containerd import ContainerdHosts, registries_of
from preheat.runtime.kubernetes.agent_images import ImagePulls, add_ready_at
from preheat.runtime.kubernetes.agent_images_mirror import start_mirror
from preheat.runtime.kubernetes.agent_leases import PodLeases
from preheat.runtime.kubernetes.agent_metrics import AgentMetrics
from preheat.runtime.kubernetes.agent_status import NodeCacheWriter
from preheat.runtime.kubernetes.agent_store_watch import POLL_S, SnapshotWatch
from preheat.runtime.kubernetes.agent_warmups import Warmups
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_status import targets_node
from preheat.runtime.kubernetes.revocations import AgentRevocations, list_revocations
from preheat.store import NodeStore
from preheat.telemetry.inventory import inventory_from_store, inventory_to_json

__all__ = ["AgentConfig", "NodeAgent", "api_client_from", "run_agent"]

log = logging.getLogger("preheat.agent")


@dataclass
class _View:
    """The watched caches (written by the watch thread, read by the loop under ``lock``)."""

    caches: dict[str, dict[str, Any]] = field(default_factory=dict)
    caches_synced: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class NodeAgent:
    """The agent's state and loops; :meth:`run` until cancelled. It owns its collaborators:
    ``warmups`` (fills, pins, priorities), ``leases`` (the pods on its node) and
    ``nodecache`` (the NodeCache status and Node labels)."""

    def __init__(self, cfg: AgentConfig, api_client: Any) -> None:
        from kubernetes import client

        self.cfg = cfg
        self.store = NodeStore(cfg.store, capacity=cfg.capacity)
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.view = _View()
        self.metrics = AgentMetrics()
        self._dirty = asyncio.Event()
        #: copies that leave (or join) the store behind the agent's back wake the loop
        self.snapshot_watch = SnapshotWatch(self.store.layout.snapshots)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.warmups = Warmups(cfg, self.store, self.metrics, self._dirty)
        self.leases = PodLeases(self.store)
        self.nodecache = NodeCacheWriter(
            cfg, self.store, (self.core, self.custom), self.metrics, self.warmups, self._wanted
        )
        # Cluster-wide revocations (Revocation objects) applied to this store.
        self.revocations = AgentRevocations(self.store, cfg.store)
        self.nodecache.extra.append(lambda: {"revocations": self.revocations.status()})

        # image cache (issue 11): pre-pulls, references, status.images, readyAt per revision
        self.images = ImagePulls(cfg, self.store, self.metrics, self._dirty)
        self.nodecache.extensions += [self.images.add_status, add_ready_at(self.store)]
        self._stop = threading.Event()
        # peers (docs/peers.md): serve the store, fill from peers within the origin budget
        self.peers = None
        if cfg.peers is not None:
            from preheat.runtime.kubernetes.agent_peers import AgentPeers

            self.peers = AgentPeers(
                cfg.node, cfg.peers, self.store, api_client, self.metrics.telemetry.registry
            )
            self.nodecache.extra.append(self.peers.status_fields)
            self.nodecache.degraded = self.peers.settings_reader.degraded
            peers = self.peers
            self.warmups.puller = lambda s, r, p: peers.pull(
                s, r, p, self._write_status, room=self.warmups.room
            )

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
                log.warning("watch %s failed (%s); re-listing in 1 s", name, describe_error(exc))
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
                self.leases.apply,
                {"field_selector": f"spec.nodeName={self.cfg.node}"},
            ),
            self.images.watch(self.custom),
        ]
        for name, fn, apply, kw in threads:
            threading.Thread(
                target=self._watch, args=(name, fn, apply), kwargs=kw, daemon=True, name=name
            ).start()

    # --- what is wanted -----------------------------------------------------------------

    def _targeting(self) -> list[dict[str, Any]]:
        """The specs of every ModelDataCache targeting this node."""
        with self.view.lock:
            caches = list(self.view.caches.values())
        specs = [o.get("spec") or {} for o in caches]
        return [
            s
            for s in specs
            if s.get("source") and targets_node(s, self.cfg.node, self.nodecache.node_labels)
        ]

    def _wanted(self) -> dict[str, tuple[str, str | None]]:
        """key -> (source, revision) of every ModelDataCache targeting this node."""
        out: dict[str, tuple[str, str | None]] = {}
        for spec in self._targeting():
            rev = spec.get("revision") or None
            out[rev or spec["source"]] = (spec["source"], rev)
        return out

    def _apply_policies(self) -> None:
        self.warmups.apply_policies(self._targeting())

    def _ensure_warmups(self) -> None:
        with self.view.lock:
            if not self.view.caches_synced:
                return
        self.warmups.ensure(self._wanted())

    def _reconcile_leases(self) -> None:
        self.leases.reconcile(self.warmups.held)

    def _apply_revocations(self) -> None:
        listed = list_revocations(self.custom)
        for line in self.revocations.sync(listed):
            log.info("node %s: %s", self.cfg.node, line)

    def _write_status(self) -> bool:
        """Write the NodeCache status when it changed; returns whether it wrote."""
        with self.view.lock:
            if not self.view.caches_synced:
                return False  # what is wanted is unknown until the first list
        return self.nodecache.write_status()

    # --- loop ---------------------------------------------------------------------------

    def inventory(self) -> str:
        """The local-mode inventory JSON of this node."""
        ready = {i.revisions[-1] if i.revisions else i.digest: True for i in self.store.snapshots()}
        inv = inventory_from_store(
            self.cfg.node,
            self.store,
            capacity_bytes=self.cfg.capacity,
            ready=ready,
            last_warmup_failure=self.warmups.last_failure,
        )
        self.metrics.telemetry.set_inventory([inv])
        self.metrics.leases.set(self.leases.count())
        return inventory_to_json([inv])

    def _containerd_hosts(self) -> None:
        # containerd's hosts.toml per cached registry (agent_containerd.py); full view only
        hosts: ContainerdHosts | None = getattr(self, "containerd_hosts", None)
        if hosts is not None and self.images.watched.synced:
            wanted = self.images.wanted(self.nodecache.node_labels)
            hosts.sync(registries_of(image for image, _, _ in wanted.values()))

    async def _reconcile(self) -> None:
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("node", self.nodecache.refresh_node),
            ("leases", self._reconcile_leases),
            ("revocations", self._apply_revocations),
            ("policies", self._apply_policies),
            ("labels", self.nodecache.label_node),
            ("images", lambda: self.images.sync_refs(self.nodecache.node_labels)),
            ("containerd", self._containerd_hosts),
        ]
        if self.peers is not None:  # invalid settings show on the NodeCache (agent_settings)
            steps.append(("settings", self.peers.settings_reader.recheck))
        steps.append(("status", self._write_status))
        for name, step in steps:
            if name == "leases":
                self._ensure_warmups()
                self.images.ensure(self.nodecache.node_labels)
            try:
                await asyncio.to_thread(step)
            except Exception as exc:
                log.warning("reconcile step %s failed: %s", name, describe_error(exc))
        self.metrics.reconciles.inc()

    async def _wait(self) -> None:
        """Until the view is dirty, the store's snapshots change (``agent_store_watch``)
        or ``resync_s`` passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.resync_s
        while (left := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), min(left, POLL_S))
                return
            if await asyncio.to_thread(self.snapshot_watch.changed):
                log.debug("node %s: the store's snapshots changed", self.cfg.node)
                return

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
        mirror: web.AppRunner | None = None
        try:
            if self.peers is not None:
                await self.peers.start()
            site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
            await site.start()
            port = runner.addresses[0][1]
            if self.cfg.mirror_port is not None:
                mirror, mport = await start_mirror(self.images.cache, "127.0.0.1",
                    self.cfg.mirror_port, self.cfg.mirror_upstream, self.metrics)  # fmt: skip
                log.info("node mirror on http://127.0.0.1:%d", mport)
                if self.cfg.containerd_hosts_dir is not None:
                    self.containerd_hosts = ContainerdHosts(
                        self.cfg.containerd_hosts_dir, f"http://127.0.0.1:{mport}"
                    )
            self._start_watches()
            if ready is not None:
                ready(f"http://{self.cfg.host}:{port}")
            while True:
                self._dirty.clear()
                await asyncio.to_thread(self.snapshot_watch.record)  # what this pass reads
                await self._reconcile()
                await self._wait()
                await asyncio.sleep(0.2)  # coalesce bursts of events
        finally:
            self._stop.set()
            self.warmups.cancel_all()
            if self.peers is not None:
                await self.peers.aclose()

            self.images.cancel_all()
            if mirror is not None:
                await mirror.cleanup()
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
