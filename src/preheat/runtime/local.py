"""Local mode: one endpoint on one machine; nodes are store directories, replicas are
processes.

``LocalFleet`` runs one endpoint on one machine:

- **Nodes** are ``NodeStore`` directories with a disk budget (the cluster file). Origin
  downloads into a node are limited to the node's ``origin_bandwidth``, so a "remote"
  fetch takes realistic time on one machine.
- **Replicas** are ``preheat engine serve --snapshot DIR`` processes (or the spec's
  command), each holding a lease on its snapshot for as long as it exists, so the store
  never evicts what a replica reads. A replica on a cold node first pulls the revision
  into that node's store itself (the slow path, recorded as a miss).
- **The router** is a ``preheat router serve`` process updated through its admin API at
  each step: an instance is added once its replica is healthy and answered a first
  request, drained before the replica stops.
- **The controller** is ``runtime.reconcile.ReconcileLoop`` (observe -> ``control.plan``
  -> execute) driving ``runtime.local_executor.LocalExecutor``; long actions run as
  tasks, so one slow download never blocks a scale-out elsewhere.

The parts: ``model`` (bookkeeping and phases), ``warmup`` (filling node stores),
``replicas`` (start, health, restarts, leases, start records), ``status`` (the status
document and inventories), ``fleetlog`` (messages and ``<state>/logs/fleet.log``).

Every replica start is written as a ``StartRecord`` to ``<state>/events.jsonl``.

Faults: a replica process that exits is restarted on its node (counted; after
``MAX_RESTARTS`` within ``RESTART_WINDOW`` seconds it is marked failed and replaced, or
its rollout is rolled back); an origin that cannot be reached makes the warm-up wait
and retry with backoff, with the reason in ``status()``; a node whose disk cannot hold
the model is reported ``unfit`` with the numbers and left out; an unexpected exception
in the controller is logged with its traceback and the loop keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections import Counter, deque
from pathlib import Path
from typing import Any

import aiohttp

from preheat.clock import Clock, SystemClock
from preheat.config import format_size
from preheat.control.spec import ClusterSpec, EndpointSpec, NodeSpec, check_against_cluster
from preheat.control.state import VariantStatus
from preheat.errors import ConfigError, ControlError
from preheat.runtime.fleetlog import FleetLog
from preheat.runtime.local_executor import LocalExecutor, describe_revisions, resolve_variants
from preheat.runtime.model import FleetState, Node, NodePhase, Replica, ResolvedVariant
from preheat.runtime.nodestore import NodeCache
from preheat.runtime.reconcile import ReconcileLoop
from preheat.runtime.replicas import Supervisor
from preheat.runtime.revocations import FleetRevocations
from preheat.runtime.router_proc import RouterProcess
from preheat.runtime.status import inventories, status_document
from preheat.runtime.warmup import Warmer
from preheat.telemetry.events import EventLog
from preheat.telemetry.inventory import NodeInventory
from preheat.telemetry.prometheus import TelemetryMetrics
from preheat.telemetry.warmups import WarmupCollector

__all__ = ["LocalFleet", "ResolvedVariant"]


class LocalFleet:
    """One endpoint on one machine (see the module docstring).

    Use as ``async with LocalFleet(spec, cluster, state_dir) as fleet: ...`` or call
    ``start()`` / ``stop()``. All methods run on the event loop that started it.
    """

    def __init__(
        self,
        spec: EndpointSpec,
        cluster: ClusterSpec,
        state_dir: Path,
        *,
        router_port: int | None = None,
        tick: float = 0.2,
        clock: Clock | None = None,
        startup_timeout: float = 300.0,
        decision_log: Path | None = None,
        decision_sample: float = 1.0,
    ) -> None:
        """``decision_log``: have the router append a sampled ``RouteDecision`` JSONL
        (share ``decision_sample`` of requests) there, for reports."""
        check_against_cluster(spec, cluster)
        if not 0.0 <= decision_sample <= 1.0:
            raise ConfigError(
                f"decision_sample {decision_sample} is outside 0-1; e.g. 0.1 logs 10% of requests"
            )
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        #: Prometheus export of start records and node inventories (own registry); fed
        #: by the event log's hook, so every start written is also counted.
        self.metrics = TelemetryMetrics()
        self.events = EventLog(state_dir / "events.jsonl", hooks=[self.metrics.observe_start])
        self.router = RouterProcess(
            state_dir,
            spec,
            router_port,
            decision_log=decision_log,
            decision_sample=decision_sample,
        )
        #: Messages for status and the console; every one also in ``logs/fleet.log``.
        self.log = FleetLog(state_dir / "logs" / "fleet.log")
        self.state = FleetState(
            spec=spec,
            cluster=cluster,
            state_dir=state_dir,
            clock=clock or SystemClock(),
            log=self.log,
            wake=lambda: self.loop.wake(),
            nodes={n.name: Node(spec=n, cache=NodeCache(n)) for n in cluster.nodes},
            replica_counts={v.name: v.replicas.min for v in spec.variants},
        )
        self.warmer = Warmer(self.state)
        self.metrics.registry.register(
            WarmupCollector(lambda: self.state.warmups, lambda: self.state.origin_bytes)
        )
        self.supervisor = Supervisor(
            self.state, self.router, self.warmer, self.events, startup_timeout=startup_timeout
        )
        #: The cluster-wide revocation list (``runtime.revocations``), kept in the state dir.
        self.revocations = FleetRevocations.load(state_dir)
        self.executor = LocalExecutor(
            self.state, self.router, self.warmer, self.supervisor, self.revocations
        )
        self.loop = ReconcileLoop(self.executor, self.log, tick=tick)
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False

    # --- the state, as attributes (tests, the CLI and the demo read these) ----------

    @property
    def spec(self) -> EndpointSpec:
        return self.state.spec

    @property
    def cluster(self) -> ClusterSpec:
        return self.state.cluster

    @property
    def state_dir(self) -> Path:
        return self.state.state_dir

    @property
    def clock(self) -> Clock:
        return self.state.clock

    @property
    def tick(self) -> float:
        return self.loop.tick

    @property
    def nodes(self) -> dict[str, Node]:
        return self.state.nodes

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.state.replicas

    @property
    def resolved(self) -> dict[str, ResolvedVariant]:
        return self.state.resolved

    @property
    def known(self) -> dict[str, ResolvedVariant]:
        return self.state.known

    @property
    def replica_counts(self) -> dict[str, int]:
        return self.state.replica_counts

    @property
    def statuses(self) -> dict[str, VariantStatus]:
        return self.state.statuses

    @property
    def waiting(self) -> dict[str, str]:
        return self.state.waiting

    @property
    def resolve_error(self) -> str | None:
        return self.state.resolve_error

    @property
    def messages(self) -> deque[str]:
        return self.log.messages

    @property
    def said(self) -> int:
        """Messages said so far (``messages`` keeps only the last 30)."""
        return self.log.said

    @property
    def origin_bytes(self) -> Counter[tuple[str, str]]:
        """(node, revision) -> bytes fetched from the origin (warm-ups and cold starts)."""
        return self.state.origin_bytes

    @property
    def restarts_total(self) -> int:
        return self.state.restarts_total

    @property
    def starts_total(self) -> int:
        return self.state.starts_total

    # --- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> LocalFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the router and the control loop; resolution and warm-up begin at once."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self.supervisor.session = self._session
        for node in self.nodes.values():
            await asyncio.to_thread(node.cache.open)
        await self.revocations.apply_to(self.nodes.values())
        await self.router.start()
        self.say(f"router listening on {self.router.url} ({self.spec.routing.strategy})")
        self._note_images(self.spec)
        self.loop.start()

    async def stop(self) -> None:
        """Stop every process this fleet started (replicas first, router last)."""
        if self._stopping:
            return
        self._stopping = True
        await self.loop.stop()
        for node in self.nodes.values():
            for t in node.warm_tasks.values():
                t.cancel()
        await self.supervisor.stop_all()
        await self.warmer.stop()
        await self.router.stop()
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                await node.cache.aclose()
        if self._session is not None:
            await self._session.close()
        self.events.close()
        self.log.close()

    # --- operator commands ----------------------------------------------------------

    async def apply(self, spec: EndpointSpec) -> None:
        """Change the spec while running; an invalid change raises and changes nothing."""
        if spec.name != self.spec.name:
            raise ConfigError(
                f"endpoint {spec.name!r}: this fleet runs {self.spec.name!r}; "
                "apply a spec with the same name, or run another `preheat up`"
            )
        check_against_cluster(spec, self.cluster)
        resolved = await resolve_variants(spec)  # raises on an unreachable origin
        st = self.state
        async with self.loop.lock:
            old = st.spec
            st.spec = spec
            self.executor.remember(resolved)
            st.fallbacks = {}  # resolved again from the new spec when a revocation needs it
            st.image_fallbacks = {}
            counts = {}
            for v in spec.variants:
                keep = st.replica_counts.get(v.name, v.replicas.min)
                counts[v.name] = min(max(keep, v.replicas.min), v.replicas.max)
            st.replica_counts = counts
            # An explicit apply is a fresh decision: revisions that failed may be retried.
            st.statuses = {
                name: dataclasses.replace(vs, failed=frozenset())
                for name, vs in st.statuses.items()
            }
            if old.routing != spec.routing or [v.name for v in old.variants] != [
                v.name for v in spec.variants
            ]:
                await self.router.apply_spec(spec)
        self.say(f"applied spec: {describe_revisions(st.resolved)}")
        self._note_images(spec)
        self.loop.wake()

    def _note_images(self, spec: EndpointSpec) -> None:
        images = sorted({v.image for v in spec.variants if v.image})
        if images and not spec.cache.image.enabled:
            self.say(
                f"image {', '.join(images)}: not cached on the nodes (local mode runs "
                "replicas as processes; set modelCacheConfig.image.enabled to pre-pull it "
                "into the node stores, docs/images.md#fleet)"
            )

    async def revoke(self, key: str, reason: str = "") -> dict[str, object]:
        """Put ``key`` on the fleet's revocation list: every node's store drops it and
        refuses it; variants that run it roll to their fallback or are reported."""
        async with self.loop.lock:
            return await self.revocations.revoke(self.state, key, reason)

    async def unrevoke(self, key: str) -> bool:
        async with self.loop.lock:
            return await self.revocations.unrevoke(self.state, key)

    async def scale(self, replicas: int, variant: str | None = None) -> None:
        """Set the replica count of a variant (the only one when not named)."""
        v = self._variant_spec(variant)
        lo, hi = v.replicas.min, v.replicas.max
        if not lo <= replicas <= hi:
            raise ConfigError(
                f"endpoint {self.spec.name!r}: variant {v.name!r} allows {lo}..{hi} replicas, "
                f"not {replicas}; change replicas.max with `preheat apply -f`"
            )
        self.replica_counts[v.name] = replicas
        self.say(f"scale {v.name} to {replicas}")
        self.loop.wake()

    async def fail_node(self, name: str) -> None:
        """Simulate losing a node: its replicas die at once; the controller replaces them."""
        node = self.state.node(name)
        if not node.up:
            raise ControlError(f"node {name!r} is already down")
        node.phase = NodePhase.DOWN
        self.warmer.cancel_node(node)
        await self.supervisor.lose_node(name)
        self.say(f"node {name} failed")
        self.loop.wake()

    async def add_node(
        self,
        name: str,
        *,
        capacity: int | None = None,
        labels: dict[str, str] | None = None,
        slots: int | None = None,
        store: Path | None = None,
    ) -> None:
        """Bring a node (back) into the cluster; a target node is warmed by the controller.
        A new node's store goes to ``store`` (default: ``<state>/nodes/NAME``)."""
        st = self.state
        if name in st.nodes:
            node = st.nodes[name]
            if node.up:
                raise ControlError(f"node {name!r} is already up")
            node.phase = NodePhase.UP
            self.say(f"node {name} is back")
        else:
            template = st.cluster.nodes[0]
            spec = NodeSpec(
                name=name,
                store=store or st.state_dir / "nodes" / name,
                capacity=capacity or template.capacity,
                labels=tuple(sorted((labels or dict(template.labels)).items())),
                slots=slots or template.slots,
                origin_bandwidth=template.origin_bandwidth,
            )
            node = Node(spec=spec, cache=NodeCache(spec), added=True)
            await asyncio.to_thread(node.cache.open)
            await self.revocations.apply_to([node])
            st.nodes[name] = node
            st.cluster = dataclasses.replace(st.cluster, nodes=(*st.cluster.nodes, spec))
            self.say(f"node {name} joined ({format_size(spec.capacity)}, {spec.slots} slots)")
        self.loop.wake()

    # --- status ---------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.log.say(text)

    def status(self) -> dict[str, Any]:
        """A JSON-able picture of the fleet (what `preheat status` prints)."""
        doc = status_document(self.state, router_url=self.router.url, events=str(self.events.path))
        doc["revocations"] = self.revocations.document()
        return doc

    async def full_status(self) -> dict[str, Any]:
        """``status()`` plus ``inventory``: each node's cache as ``NodeInventory.to_dict()``
        (revisions, bytes, last use, leases, pins, priority, free space, eviction order,
        readiness, last warm-up failure), read from the stores off the event loop."""
        st = self.status()
        st["inventory"] = [n.to_dict() for n in await asyncio.to_thread(self.inventory)]
        return st

    def inventory(self) -> list[NodeInventory]:
        """Each node's cache (from its store) joined with the controller's readiness and
        its last warm-up failure, for reports and `/metrics`."""
        return inventories(self.state)

    def metrics_text(self) -> bytes:
        """The fleet's ``/metrics`` body: start histograms, cache hits, node inventories."""
        self.metrics.set_inventory(self.inventory())
        return self.metrics.exposition()

    def fetched_bytes(self, revision: str) -> int:
        """Bytes fetched from the origin for ``revision`` over all nodes."""
        return sum(n for (_, rev), n in self.origin_bytes.items() if rev == revision)

    def ready_count(self, variant: str | None = None, revision: str | None = None) -> int:
        return self.state.ready_count(variant, revision)

    async def wait_until(self, predicate: Any, timeout: float, what: str) -> None:
        """Wait until ``predicate(self)`` holds; ControlError with the status if not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            if loop.time() > deadline:
                raise ControlError(
                    f"timed out after {timeout:.0f} s waiting for {what}; status:\n"
                    + json.dumps(self.status(), indent=1)[:4000]
                )
            await asyncio.sleep(0.05)

    # --- helpers --------------------------------------------------------------------

    def _variant_spec(self, name: str | None) -> Any:
        if name is None:
            if len(self.spec.variants) != 1:
                raise ConfigError(
                    f"endpoint {self.spec.name!r} has variants "
                    f"{', '.join(v.name for v in self.spec.variants)}; name one with --variant"
                )
            return self.spec.variants[0]
        return self.spec.variant(name)
