"""The local executor: nodes are store directories, replicas are processes.

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
- **The controller** is a loop: observe -> ``control.plan.plan`` -> execute the actions
  (long ones as tasks, so one slow download never blocks a scale-out elsewhere).

Every replica start is written as a ``StartRecord`` to ``<state>/events.jsonl``.

Faults: a replica process that exits is restarted on its node (counted; after
``MAX_RESTARTS`` within ``RESTART_WINDOW`` seconds it is marked failed and replaced, or
its rollout is rolled back); an origin that cannot be reached makes the warm-up wait
and retry with backoff, with the reason in ``status()``; a node whose disk cannot hold
the model is reported ``unfit`` with the numbers and left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import shlex
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from preheat.clock import Clock, SystemClock
from preheat.config import format_size
from preheat.control.autoscale import AutoscaleState, autoscale
from preheat.control.plan import plan
from preheat.control.spec import (
    ClusterSpec,
    CommandEngine,
    EndpointSpec,
    NodeSpec,
    SimulatedEngine,
    VariantSpec,
    check_against_cluster,
)
from preheat.control.state import (
    Action,
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
    VariantStatus,
    WaitGate,
    Warm,
    WeightsPolicy,
    revision_of,
)
from preheat.errors import (
    ConfigError,
    ControlError,
    FetchError,
    InsufficientSpace,
    PreheatError,
)
from preheat.runtime.nodestore import NodeCache, PullOutcome, resolve_source
from preheat.runtime.procs import Child, free_port, preheat_command, spawn, wait_http_ok
from preheat.runtime.router_proc import RouterProcess
from preheat.telemetry.classify import StartContext, StartReason, classify_start
from preheat.telemetry.events import EventLog, StartRecord
from preheat.telemetry.inventory import NodeInventory, WarmupFailure, inventory_from_store
from preheat.telemetry.prometheus import TelemetryMetrics

__all__ = ["LocalFleet", "ResolvedVariant"]

MAX_RESTARTS = 3
RESTART_WINDOW = 120.0
WARM_BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0)
DRAIN_TIMEOUT = 30.0
AUTOSCALE_SAMPLE = 0.25  # seconds between samples of the router's in-flight counts
AUTOSCALE_WINDOW = 2.0  # seconds of samples averaged into one load figure


@dataclass(frozen=True)
class ResolvedVariant:
    """A variant's source resolved once, when the spec was applied."""

    variant: str
    source: str
    revision: str
    model_bytes: int
    files: int


@dataclass
class _Node:
    spec: NodeSpec
    cache: NodeCache
    up: bool = True
    #: Joined by ``node add`` while the fleet ran (not in the cluster file). With
    #: ``hosted_any`` this makes a start ``new_node`` (see ``_node_is_new``).
    added: bool = False
    #: Has hosted (started) a replica of this endpoint.
    hosted_any: bool = False
    views: dict[str, CacheView] = field(default_factory=dict)
    warm_failures: Counter[str] = field(default_factory=Counter)
    warm_tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    last_failure: WarmupFailure | None = None


@dataclass
class _Replica:
    id: str
    variant: str
    revision: str
    node: str
    seq: int
    reason: StartReason
    template: str = ""
    phase: str = "starting"
    routed: bool = False
    port: int = 0
    child: Child | None = None
    lease: Any = None
    snapshot: Path | None = None
    restarts: int = 0
    restart_times: deque[float] = field(default_factory=deque)
    detail: str = "scheduled"
    stopping: bool = False
    task: asyncio.Task[None] | None = None
    weights_source: str = "cache"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _node_is_new(node: _Node) -> bool:
    """A node is new to the endpoint until it hosts a replica, if it joined by ``node add``
    while the fleet ran: after the first replica became healthy, or while the first
    replicas were still starting (it never hosted one either way). Nodes of the cluster
    file are not new: they were there when the deployment was planned, so a first start
    on one is ``scale_out`` or ``cold_pod_warm_node`` (see ``telemetry.classify``)."""
    return node.added and not node.hosted_any


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
        self.spec = spec
        self.cluster = cluster
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock or SystemClock()
        self.tick = tick
        self.startup_timeout = startup_timeout
        #: Prometheus export of start records and node inventories (own registry); fed
        #: by the event log's hook, so every start written is also counted.
        self.metrics = TelemetryMetrics()
        self.events = EventLog(self.state_dir / "events.jsonl", hooks=[self.metrics.observe_start])
        self.router = RouterProcess(
            self.state_dir,
            spec,
            router_port,
            decision_log=decision_log,
            decision_sample=decision_sample,
        )
        self.nodes: dict[str, _Node] = {
            n.name: _Node(spec=n, cache=NodeCache(n)) for n in cluster.nodes
        }
        self.replicas: dict[str, _Replica] = {}
        self.resolved: dict[str, ResolvedVariant] = {}
        #: Every revision resolved so far (old ones serve until rolled out, or come back
        #: on a rollback).
        self.known: dict[str, ResolvedVariant] = {}
        #: template fingerprint -> (engine, image) a replica of that template runs.
        self.templates: dict[str, tuple[Any, str | None]] = {}
        self.replica_counts: dict[str, int] = {v.name: v.replicas.min for v in spec.variants}
        self.statuses: dict[str, VariantStatus] = {}
        self.messages: deque[str] = deque(maxlen=30)
        #: Messages said so far (``messages`` keeps only the last 30).
        self.said = 0
        self.waiting: dict[str, str] = {}
        self.resolve_error: str | None = None
        self.restarts_total = 0
        #: (node, revision) -> bytes fetched from the origin (warm-ups and cold starts).
        self.origin_bytes: Counter[tuple[str, str]] = Counter()
        self.starts_total = 0
        self._seq = 0
        self._lost_pending: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._resolve_retry_at = 0.0
        self._resolve_failures = 0
        self._lock = asyncio.Lock()
        self._bg: set[asyncio.Task[None]] = set()
        self._load_samples: deque[tuple[float, dict[str, int]]] = deque()
        self._start_failures: Counter[str] = Counter()
        self._next_start_at: dict[str, float] = {}
        self._autoscale_state: dict[str, AutoscaleState] = {}

    # --- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> LocalFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the router and the control loop; resolution and warm-up begin at once."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        for node in self.nodes.values():
            await asyncio.to_thread(node.cache.open)
        await self.router.start()
        self.say(f"router listening on {self.router.url} ({self.spec.routing.strategy})")
        self._note_images(self.spec)
        self._loop_task = asyncio.create_task(self._loop(), name="preheat-reconcile")

    async def stop(self) -> None:
        """Stop every process this fleet started (replicas first, router last)."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        for node in self.nodes.values():
            for t in node.warm_tasks.values():
                t.cancel()
        tasks = [r.task for r in self.replicas.values() if r.task is not None]
        tasks += list(self._bg)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await asyncio.gather(
            *(self._kill_replica(r) for r in list(self.replicas.values())),
            return_exceptions=True,
        )
        for node in self.nodes.values():
            for t in node.warm_tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        await self.router.stop()
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                await node.cache.aclose()
        if self._session is not None:
            await self._session.close()
        self.events.close()

    # --- operator commands ----------------------------------------------------------

    async def apply(self, spec: EndpointSpec) -> None:
        """Change the spec while running; an invalid change raises and changes nothing."""
        if spec.name != self.spec.name:
            raise ConfigError(
                f"endpoint {spec.name!r}: this fleet runs {self.spec.name!r}; "
                "apply a spec with the same name, or run another `preheat up`"
            )
        check_against_cluster(spec, self.cluster)
        resolved = await self._resolve_all(spec)  # raises on an unreachable origin
        async with self._lock:
            old = self.spec
            self.spec = spec
            self.resolved = resolved
            counts = {}
            for v in spec.variants:
                keep = self.replica_counts.get(v.name, v.replicas.min)
                counts[v.name] = min(max(keep, v.replicas.min), v.replicas.max)
            self.replica_counts = counts
            # An explicit apply is a fresh decision: revisions that failed may be retried.
            self.statuses = {
                name: dataclasses.replace(st, failed=frozenset())
                for name, st in self.statuses.items()
            }
            if old.routing != spec.routing or [v.name for v in old.variants] != [
                v.name for v in spec.variants
            ]:
                await self.router.apply_spec(spec)
        self.say(f"applied spec: {self._describe_revisions()}")
        self._note_images(spec)
        self._wake.set()

    def _note_images(self, spec: EndpointSpec) -> None:
        images = sorted({v.image for v in spec.variants if v.image})
        if images or spec.cache.image.enabled:
            self.say(
                f"image {', '.join(images) or '(none)'}: local mode runs replicas as processes, "
                "so no image is pulled and modelCacheConfig.image does not apply here "
                "(it does in Kubernetes mode)"
            )

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
        self._wake.set()

    async def fail_node(self, name: str) -> None:
        """Simulate losing a node: its replicas die at once; the controller replaces them."""
        node = self._node(name)
        if not node.up:
            raise ControlError(f"node {name!r} is already down")
        node.up = False
        for rev, task in list(node.warm_tasks.items()):
            if not task.done():
                task.cancel()
                node.views.pop(rev, None)  # warmed again when the node comes back
        for r in list(self.replicas.values()):
            if r.node == name and r.phase in ("starting", "ready", "draining"):
                self._lost_pending[r.variant] += 1
                if r.task is not None:
                    r.task.cancel()
                if r.child is not None:
                    await r.child.stop(sig=9)
                r.detail = f"lost with node {name}"
        self.say(f"node {name} failed")
        self._wake.set()

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
        if name in self.nodes:
            node = self.nodes[name]
            if node.up:
                raise ControlError(f"node {name!r} is already up")
            node.up = True
            self.say(f"node {name} is back")
        else:
            template = self.cluster.nodes[0]
            spec = NodeSpec(
                name=name,
                store=store or self.state_dir / "nodes" / name,
                capacity=capacity or template.capacity,
                labels=tuple(sorted((labels or dict(template.labels)).items())),
                slots=slots or template.slots,
                origin_bandwidth=template.origin_bandwidth,
            )
            node = _Node(spec=spec, cache=NodeCache(spec), added=True)
            await asyncio.to_thread(node.cache.open)
            self.nodes[name] = node
            self.cluster = dataclasses.replace(self.cluster, nodes=(*self.cluster.nodes, spec))
            self.say(f"node {name} joined ({format_size(spec.capacity)}, {spec.slots} slots)")
        self._wake.set()

    # --- status ---------------------------------------------------------------------

    def say(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.messages.append(f"{stamp} {text}")
        self.said += 1

    def status(self) -> dict[str, Any]:
        """A JSON-able picture of the fleet (what `preheat status` prints)."""
        revs = {rv.revision: rv for rv in self.resolved.values()}
        nodes = []
        for n in self.nodes.values():
            cache = {}
            for rev, view in n.views.items():
                entry: dict[str, Any] = {"state": view.state}
                if view.reason:
                    entry["reason"] = view.reason
                if rev in n.progress:
                    done, total = n.progress[rev]
                    entry["progress"] = [done, total]
                cache[rev] = entry
            nodes.append(
                {
                    "name": n.spec.name,
                    "up": n.up,
                    "target": self._is_target(n),
                    "slots": n.spec.slots,
                    "replicas": sum(
                        1
                        for r in self.replicas.values()
                        if r.node == n.spec.name and r.phase != "stopped"
                    ),
                    "capacity": n.spec.capacity,
                    "used": n.cache.used_bytes(),
                    "labels": dict(n.spec.labels),
                    "cache": cache,
                }
            )
        replicas = [
            {
                "id": r.id,
                "variant": r.variant,
                "revision": r.revision,
                "node": r.node,
                "phase": r.phase,
                "routed": r.routed,
                "url": r.url if r.port else None,
                "restarts": r.restarts,
                "weights": r.weights_source,
                "detail": r.detail,
            }
            for r in sorted(self.replicas.values(), key=lambda r: r.seq)
            if r.phase != "stopped"
        ]
        variants = []
        for v in self.spec.variants:
            rv = self.resolved.get(v.name)
            st = self.statuses.get(v.name, VariantStatus())
            variants.append(
                {
                    "name": v.name,
                    "source": v.model.source,
                    "revision": rv.revision if rv else None,
                    "model_bytes": rv.model_bytes if rv else None,
                    "stable": revision_of(st.stable) if st.stable else None,
                    "stable_version": st.stable,
                    "failed": sorted(st.failed),
                    "replicas": self.replica_counts.get(v.name, 0),
                    "ready": sum(
                        1
                        for r in self.replicas.values()
                        if r.variant == v.name and r.phase == "ready" and r.routed
                    ),
                    "waiting": self.waiting.get(v.name),
                    "weight": v.weight,
                }
            )
        return {
            "endpoint": self.spec.name,
            "router": {
                "url": self.router.url,
                "strategy": self.spec.routing.strategy,
                "prefix_length": self.spec.routing.prefix_length,
                "concurrency_threshold": self.spec.routing.concurrency_threshold,
            },
            "resolving": self.resolve_error,
            "variants": variants,
            "nodes": nodes,
            "replicas": replicas,
            "revisions": {
                r: {"bytes": rv.model_bytes, "files": rv.files} for r, rv in revs.items()
            },
            "starts": self.starts_total,
            "restarts": self.restarts_total,
            "events": str(self.events.path),
            "messages": list(self.messages),
        }

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
        out = []
        for n in list(self.nodes.values()):  # may run in a worker thread: iterate copies
            if n.cache.closed:
                continue
            failure = n.last_failure
            out.append(
                inventory_from_store(
                    n.spec.name,
                    n.cache.store,
                    capacity_bytes=n.spec.capacity,
                    ready={rev: v.state == "ready" for rev, v in list(n.views.items())},
                    last_warmup_failure=failure,
                )
            )
        return out

    def metrics_text(self) -> bytes:
        """The fleet's ``/metrics`` body: start histograms, cache hits, node inventories."""
        self.metrics.set_inventory(self.inventory())
        return self.metrics.exposition()

    def fetched_bytes(self, revision: str) -> int:
        """Bytes fetched from the origin for ``revision`` over all nodes."""
        return sum(n for (_, rev), n in self.origin_bytes.items() if rev == revision)

    def ready_count(self, variant: str | None = None, revision: str | None = None) -> int:
        return sum(
            1
            for r in self.replicas.values()
            if r.phase == "ready"
            and r.routed
            and (variant is None or r.variant == variant)
            and (revision is None or r.revision == revision)
        )

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

    # --- the control loop -----------------------------------------------------------

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                async with self._lock:
                    await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep reconciling; say what went wrong
                self.say(f"reconcile error: {type(exc).__name__}: {exc}")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick)

    async def _reconcile(self) -> None:
        if len(self.resolved) < len(self.spec.variants):
            if self.clock.now() < self._resolve_retry_at:
                return
            try:
                self.resolved = await self._resolve_all(self.spec)
                self.resolve_error = None
                self._resolve_failures = 0
                self.say(f"resolved {self._describe_revisions()}")
            except FetchError as exc:
                delay = WARM_BACKOFF[min(self._resolve_failures, len(WARM_BACKOFF) - 1)]
                self._resolve_failures += 1
                self._resolve_retry_at = self.clock.now() + delay
                self.resolve_error = f"{exc}; retrying in {delay:.0f} s"
                return
            await self._adopt_existing()
        if self.spec.autoscaling is not None:
            await self._autoscale()
        desired = self._desired()
        observed = self._observe()
        for action in plan(desired, observed):
            await self._execute(action)

    async def _autoscale(self) -> None:
        """Sample the router's in-flight counts; let ``control.autoscale`` set the counts."""
        policy = self.spec.autoscaling
        assert policy is not None
        now = self.clock.now()
        if self._load_samples and now - self._load_samples[-1][0] < AUTOSCALE_SAMPLE:
            return
        try:
            config = await self.router.get_config()
        except ControlError:
            return
        per_variant = {
            v["name"]: sum(
                int(i.get("in_flight", 0)) for i in v.get("instances", []) if isinstance(i, dict)
            )
            for v in config.get("variants", [])
        }
        self._load_samples.append((now, per_variant))
        while self._load_samples and now - self._load_samples[0][0] > AUTOSCALE_WINDOW:
            self._load_samples.popleft()
        for v in self.spec.variants:
            samples = [s.get(v.name, 0) for _, s in self._load_samples]
            in_flight = sum(samples) / max(len(samples), 1)
            current = self.replica_counts.get(v.name, v.replicas.min)
            new, state, why = autoscale(
                current=current,
                lo=v.replicas.min,
                hi=v.replicas.max,
                in_flight=in_flight,
                serving=self.ready_count(v.name),
                policy=policy,
                now=now,
                state=self._autoscale_state.get(v.name, AutoscaleState()),
            )
            self._autoscale_state[v.name] = state
            if new != current:
                self.replica_counts[v.name] = new
                self.say(f"autoscale {v.name}: {why}")

    async def _resolve_all(self, spec: EndpointSpec) -> dict[str, ResolvedVariant]:
        out: dict[str, ResolvedVariant] = {}
        cache: dict[str, ResolvedVariant] = {}
        for v in spec.variants:
            if v.model.source not in cache:
                revision, total, files = await resolve_source(v.model.source)
                if v.model.revision is not None and v.model.revision != revision:
                    raise ConfigError(
                        f"endpoint {spec.name!r}: variant {v.name!r} model.revision "
                        f"{v.model.revision!r} does not match what {v.model.source} resolves "
                        f"to now ({revision!r}); update model.revision or the origin"
                    )
                cache[v.model.source] = ResolvedVariant(
                    v.name, v.model.source, revision, total, files
                )
            rv = cache[v.model.source]
            out[v.name] = dataclasses.replace(rv, variant=v.name)
        for rv in out.values():
            self.known[rv.revision] = rv
        return out

    async def _adopt_existing(self) -> None:
        """Nodes whose store already holds a wanted revision are ready for it."""
        for node in self.nodes.values():
            for rv in self.resolved.values():
                if rv.revision in node.views:
                    continue
                if await asyncio.to_thread(node.cache.has, rv.revision):
                    node.views[rv.revision] = CacheView("ready")

    def _desired(self) -> Desired:
        w = self.spec.cache.weights
        return Desired(
            endpoint=self.spec.name,
            variants=tuple(
                DesiredVariant(
                    v.name,
                    self.resolved[v.name].revision,
                    self.resolved[v.name].model_bytes,
                    self.replica_counts.get(v.name, v.replicas.min),
                    v.weight,
                    template=self._template(v),
                )
                for v in self.spec.variants
            ),
            weights=WeightsPolicy(
                enabled=w.enabled,
                min_ready=w.min_ready,
                timeout_seconds=w.timeout_seconds,
                pin=w.pin,
                priority=w.priority,
            ),
        )

    def _is_target(self, node: _Node) -> bool:
        w = self.spec.cache.weights
        return w.enabled and w.nodes.matches(node.spec.name, node.spec.label_map)

    def _observe(self) -> Observed:
        nodes = tuple(
            NodeView(
                name=n.spec.name,
                up=n.up,
                slots=n.spec.slots,
                target=self._is_target(n),
                cache=tuple(sorted(n.views.items())),
            )
            for n in self.nodes.values()
        )
        replicas = tuple(
            ReplicaView(
                r.id,
                r.variant,
                r.revision,
                r.node,
                r.phase,  # type: ignore[arg-type]
                routed=r.routed,
                seq=r.seq,
                template=r.template,
            )
            for r in self.replicas.values()
            if r.phase != "stopped"
        )
        return Observed(
            now=self.clock.now(),
            nodes=nodes,
            replicas=replicas,
            variants=tuple(self.statuses.items()),
        )

    async def _execute(self, a: Action) -> None:
        if isinstance(a, Warm):
            self._start_warm(a.node, a.revision)
        elif isinstance(a, WaitGate):
            st = self.statuses.get(a.variant, VariantStatus())
            if st.waiting_since(a.revision) is None:
                self.statuses[a.variant] = dataclasses.replace(
                    st, gate_since=(*st.gate_since, (a.revision, self.clock.now()))
                )
                self.say(
                    f"{a.variant}: waiting for {a.needed} target nodes to hold "
                    f"{a.revision[:12]} before creating replicas"
                )
            reasons = []
            for name in a.waiting_on:
                view = self.nodes[name].views.get(a.revision, CacheView("absent"))
                prog = self.nodes[name].progress.get(a.revision)
                extra = f" {100 * prog[0] / max(prog[1], 1):.0f}%" if prog else ""
                reasons.append(
                    f"{name}: {view.state}{extra}" + (f" ({view.reason})" if view.reason else "")
                )
            self.waiting[a.variant] = (
                f"cache gate: {a.ready}/{a.needed} target nodes ready; " + "; ".join(reasons)
            )
        elif isinstance(a, OpenGate):
            st = self.statuses.get(a.variant, VariantStatus())
            self.statuses[a.variant] = dataclasses.replace(
                st, gate_open=st.gate_open | {a.revision}
            )
            self.waiting.pop(a.variant, None)
            self.say(
                f"{a.variant}: cache gate open for {a.revision[:12]} "
                f"({a.ready}/{a.needed} target nodes ready)"
            )
        elif isinstance(a, Notice):
            self.say(a.text)
        elif isinstance(a, Unschedulable):
            self.waiting[a.variant] = f"{a.missing} replica(s) cannot be placed: {a.reason}"
        elif isinstance(a, StartReplica):
            wait = self._next_start_at.get(a.variant, 0.0) - self.clock.now()
            if wait > 0:
                # CrashLoopBackOff, as it were: failed starts back off exponentially.
                self.waiting[a.variant] = (
                    f"{self._start_failures[a.variant]} replica start(s) failed in a row; "
                    f"next try in {wait:.0f} s (see {self.state_dir / 'logs'})"
                )
                return
            self.waiting.pop(a.variant, None)
            self._start_replica(a)
        elif isinstance(a, AddRoute):
            r = self.replicas.get(a.replica)
            if r is not None and r.phase == "ready" and not r.routed:
                await self.router.add(r.variant, r.url)
                r.routed = True
                r.detail = "serving"
                self.say(f"{r.id} on {r.node} is in the router")
        elif isinstance(a, Drain):
            r = self.replicas.get(a.replica)
            if r is not None and r.phase in ("starting", "ready"):
                r.phase = "draining"
                r.detail = f"draining: {a.reason}"
                self.say(f"draining {r.id} on {r.node} ({a.reason})")
                t = asyncio.create_task(self._drain(r), name=f"drain-{r.id}")
                self._bg.add(t)
                t.add_done_callback(self._bg.discard)
        elif isinstance(a, StopReplica):
            r = self.replicas.get(a.replica)
            if r is not None and r.phase != "stopped":
                self.say(f"stopping {r.id} on {r.node} ({a.reason})")
                await self._kill_replica(r)
        elif isinstance(a, FinishRollout):
            st = self.statuses.get(a.variant, VariantStatus())
            self.statuses[a.variant] = dataclasses.replace(st, stable=a.revision)
            if a.previous is None:
                self.say(f"{a.variant}: deployed {a.revision[:12]}")
            else:
                self.say(f"{a.variant}: rolled out {a.revision[:20]} (was {a.previous[:20]})")
        elif isinstance(a, Rollback):
            st = self.statuses.get(a.variant, VariantStatus())
            self.statuses[a.variant] = dataclasses.replace(
                st, failed=st.failed | {a.revision}, stable=st.stable or a.to
            )
            self.say(f"{a.variant}: rolling back to {a.to[:12]}: {a.reason}")
        elif isinstance(a, DeleteRevision):
            node = self.nodes[a.node]
            node.views.pop(a.revision, None)
            node.progress.pop(a.revision, None)
            try:
                freed = await asyncio.to_thread(node.cache.delete, a.revision)
                self.say(f"deleted {a.revision[:12]} from {a.node} ({format_size(freed)} freed)")
            except PreheatError as exc:
                self.say(f"could not delete {a.revision[:12]} from {a.node}: {exc}")

    # --- warming --------------------------------------------------------------------

    def _rv(self, revision: str) -> ResolvedVariant:
        rv = self.known.get(revision)
        if rv is None:
            raise ControlError(f"revision {revision} is not one this endpoint resolved")
        return rv

    def _template(self, v: VariantSpec) -> str:
        """Fingerprint of how a replica runs (engine and image): part of the version."""
        text = json.dumps([type(v.engine).__name__, dataclasses.asdict(v.engine), v.image])
        tpl = hashlib.sha256(text.encode()).hexdigest()[:10]
        self.templates.setdefault(tpl, (v.engine, v.image))
        return tpl

    def _start_warm(self, node_name: str, revision: str) -> None:
        node = self.nodes[node_name]
        if revision in node.warm_tasks and not node.warm_tasks[revision].done():
            return
        node.views[revision] = CacheView("warming")
        node.warm_tasks[revision] = asyncio.create_task(
            self._warm(node, revision), name=f"warm-{node_name}"
        )

    async def _pull(self, node: _Node, revision: str) -> PullOutcome:
        """Pull ``revision`` into ``node``; updates the node's cache view either way."""
        rv = self._rv(revision)
        node.views[revision] = CacheView("warming")

        def progress(done: int, total: int) -> None:
            node.progress[revision] = (done, total)

        try:
            outcome = await node.cache.pull(rv.source, revision, progress=progress)
        except InsufficientSpace as exc:
            node.views[revision] = CacheView("unfit", reason=str(exc))
            node.last_failure = WarmupFailure(revision, str(exc), self.clock.wall())
            self.say(f"{node.spec.name} cannot hold {revision[:12]}: {exc}")
            raise
        except (FetchError, PreheatError, OSError) as exc:
            n = node.warm_failures[revision]
            node.warm_failures[revision] += 1
            delay = WARM_BACKOFF[min(n, len(WARM_BACKOFF) - 1)]
            node.views[revision] = CacheView(
                "failed",
                reason=f"{exc}; retry {n + 1} in {delay:.0f} s",
                retry_at=self.clock.now() + delay,
            )
            node.last_failure = WarmupFailure(revision, str(exc), self.clock.wall())
            self.say(f"warm-up of {revision[:12]} on {node.spec.name} failed: {exc}")
            raise
        finally:
            node.progress.pop(revision, None)
        node.warm_failures.pop(revision, None)
        # The node's last warm-up now succeeded: its failure is history (said above).
        node.last_failure = None
        self.origin_bytes[(node.spec.name, revision)] += outcome.bytes_fetched
        node.views[revision] = CacheView("ready")
        if self.spec.cache.weights.pin:
            await asyncio.to_thread(node.cache.pin, revision, self.spec.cache.weights.priority)
        self._wake.set()
        return outcome

    async def _warm(self, node: _Node, revision: str) -> None:
        with contextlib.suppress(PreheatError, OSError):
            outcome = await self._pull(node, revision)
            self.say(
                f"warmed {revision[:12]} on {node.spec.name}: "
                f"{format_size(outcome.bytes_fetched)} from origin, "
                f"{format_size(outcome.bytes_reused)} reused, {outcome.seconds:.1f} s"
            )

    # --- replicas -------------------------------------------------------------------

    def _start_replica(self, a: StartReplica) -> None:
        self._seq += 1
        rid = f"{a.variant}-{self._seq}"
        reason = StartReason.INITIAL
        if a.reason == "rollout":
            reason = StartReason.ROLLOUT
        elif self._lost_pending[a.variant] > 0:
            self._lost_pending[a.variant] -= 1
            reason = StartReason.NODE_LOSS
        elif a.reason == "scale_out":
            reason = StartReason.SCALE_OUT
        r = _Replica(rid, a.variant, a.revision, a.node, self._seq, reason, template=a.template)
        self.replicas[rid] = r
        self.starts_total += 1
        r.task = asyncio.create_task(self._run_replica(r), name=f"replica-{rid}")

    def _engine_argv(self, r: _Replica) -> list[str]:
        engine = self.templates[r.template][0] if r.template in self.templates else None
        if engine is None:
            engine = self.spec.variant(r.variant).engine
        assert r.snapshot is not None
        if isinstance(engine, CommandEngine):
            text = engine.command.format(
                snapshot=shlex.quote(str(r.snapshot)),
                port=r.port,
                host="127.0.0.1",
                model=shlex.quote(self.spec.name),
                replica=r.id,
            )
            return shlex.split(text)
        assert isinstance(engine, SimulatedEngine)
        argv = preheat_command(
            "engine",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(r.port),
            "--profile",
            engine.profile,
            "--snapshot",
            str(r.snapshot),
            "--time-scale",
            str(engine.time_scale),
            "--model-name",
            self.spec.name,
        )
        if engine.kv_blocks is not None:
            argv += ["--kv-blocks", str(engine.kv_blocks)]
        return argv

    async def _run_replica(self, r: _Replica) -> None:
        """Bring a replica up, record its start, then supervise it (restart on exit)."""
        node = self.nodes[r.node]
        same_node_before = False
        while True:
            ctx = StartContext(
                reason=r.reason,
                node_had_revision=node.views.get(r.revision, CacheView("absent")).state == "ready",
                node_is_new=_node_is_new(node),
                same_replica_on_node_before=same_node_before,
            )
            node.hosted_any = True
            ok = await self._start_once(r, node, ctx)
            if not ok:
                if r.phase == "stopped":
                    return
                r.phase = "failed"
                self._start_failures[r.variant] += 1
                n = self._start_failures[r.variant]
                self._next_start_at[r.variant] = self.clock.now() + min(0.5 * 2 ** (n - 1), 30.0)
                return
            self._start_failures[r.variant] = 0
            same_node_before = True
            assert r.child is not None
            code = await r.child.proc.wait()
            if r.stopping or r.phase in ("draining", "stopped"):
                return
            # The process exited on its own: take it out of the router, restart it here.
            self.restarts_total += 1
            r.restarts += 1
            now = self.clock.now()
            r.restart_times.append(now)
            while r.restart_times and now - r.restart_times[0] > RESTART_WINDOW:
                r.restart_times.popleft()
            tail = r.child.tail(2)
            self.say(f"{r.id} on {r.node} exited with code {code}; restart {r.restarts}: {tail}")
            await self._unroute(r)
            if len(r.restart_times) > MAX_RESTARTS:
                self._start_failures[r.variant] += 1
                r.phase = "failed"
                r.detail = f"crashed {len(r.restart_times)} times in {RESTART_WINDOW:.0f} s"
                self._wake.set()
                return
            r.phase = "starting"
            r.detail = f"restarting after exit code {code}"
            r.reason = StartReason.RESTART
            self._wake.set()
            await asyncio.sleep(min(0.2 * 2 ** (r.restarts - 1), 5.0))

    async def _start_once(self, r: _Replica, node: _Node, ctx: StartContext) -> bool:
        assert self._session is not None
        scheduled = self.clock.wall()
        weights_source = "cache"
        bytes_from: dict[str, int] = {}
        failure: str | None = None
        stamps: dict[str, float | None] = {}
        event_class = classify_start(ctx)
        try:
            # Weights: a lease on the node's snapshot, pulling it first on a cold node.
            if r.snapshot is None:
                snap = await asyncio.to_thread(node.cache.snapshot_dir, r.revision)
                if snap is None:
                    weights_source = "origin"
                    r.weights_source = "origin"
                    r.detail = "fetching weights from origin (cold node)"
                    outcome = await self._pull_for_replica(r, node)
                    bytes_from = {"origin": outcome.bytes_fetched, "cache": outcome.bytes_reused}
                    snap = outcome.snapshot
                else:
                    rv = self._rv(r.revision)
                    bytes_from = {"cache": rv.model_bytes}
                r.lease = await asyncio.to_thread(node.cache.lease, r.revision, r.id)
                r.snapshot = snap
            else:
                bytes_from = {"cache": self._rv(r.revision).model_bytes}
            stamps["weights_ready"] = self.clock.wall()
            # Runtime.
            r.port = free_port()
            r.detail = "starting engine"
            r.child = await spawn(self._engine_argv(r), self.state_dir / "logs" / f"{r.id}.log")
            stamps["runtime_started"] = self.clock.wall()
            r.detail = "loading weights"
            healthy = await wait_http_ok(
                self._session, f"{r.url}/health", timeout=self.startup_timeout, child=r.child
            )
            if not healthy:
                failure = (
                    f"exited with code {r.child.proc.returncode}: {r.child.tail(3)}"
                    if not r.child.running
                    else f"not healthy within {self.startup_timeout:.0f} s"
                )
                raise ControlError(failure)
            stamps["healthy"] = self.clock.wall()
            stamps.update(await self._engine_stages(r))
            # First response, straight to the replica (the router adds it afterwards).
            await self._first_response(r)
            stamps["first_response"] = self.clock.wall()
            r.phase = "ready"
            r.detail = "ready; joining the router"
            self._wake.set()
            return True
        except asyncio.CancelledError:
            failure = failure or "cancelled"
            raise
        except (PreheatError, OSError, aiohttp.ClientError, TimeoutError) as exc:
            failure = failure or f"{type(exc).__name__}: {exc}"
            r.detail = f"start failed: {failure}"
            if r.child is not None:
                await r.child.stop()
            if isinstance(exc, InsufficientSpace):
                r.phase = "failed"
            self._wake.set()
            return False
        finally:
            self._record(r, scheduled, stamps, event_class, weights_source, bytes_from, failure)

    async def _pull_for_replica(self, r: _Replica, node: _Node) -> PullOutcome:
        """A replica on a cold node fetches the revision from the origin itself, waiting
        out an unreachable origin (status shows why) until the replica is stopped."""
        # Share a warm-up that is already running on this node.
        task = node.warm_tasks.get(r.revision)
        if task is not None and not task.done():
            r.detail = "waiting for this node's warm-up"
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        attempt = 0
        while True:
            try:
                return await self._pull(node, r.revision)
            except InsufficientSpace:
                raise
            except (FetchError, PreheatError, OSError) as exc:
                delay = WARM_BACKOFF[min(attempt, len(WARM_BACKOFF) - 1)]
                attempt += 1
                r.detail = f"origin fetch failed ({exc}); retrying in {delay:.0f} s"
                await asyncio.sleep(delay)

    async def _engine_stages(self, r: _Replica) -> dict[str, float | None]:
        """``runtime_started`` / ``weights_loaded`` as the engine reports them (``/startup``)."""
        assert self._session is not None
        try:
            async with self._session.get(f"{r.url}/startup") as resp:
                if resp.status != 200:
                    return {}
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return {}
        stages = data.get("stages", data) if isinstance(data, dict) else {}
        out: dict[str, float | None] = {}
        for name in ("runtime_started", "weights_loaded"):
            v = stages.get(name) if isinstance(stages, dict) else None
            if isinstance(v, int | float):
                out[name] = float(v)
        return out

    async def _first_response(self, r: _Replica) -> None:
        assert self._session is not None
        body = {"model": self.spec.name, "prompt": "preheat warm-up", "max_tokens": 1}
        async with self._session.post(f"{r.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                raise ControlError(f"first request -> {resp.status}: {text[:200]}")
            await resp.read()

    def _record(
        self,
        r: _Replica,
        scheduled: float,
        stamps: dict[str, float | None],
        event_class: Any,
        weights_source: str,
        bytes_from: dict[str, int],
        failure: str | None,
    ) -> None:
        # Keep boundaries monotonic: an engine-reported time may predate our own stamp by
        # clock granularity; clamp it between its neighbours.
        order = ["weights_ready", "runtime_started", "weights_loaded", "healthy", "first_response"]
        prev = scheduled
        clean: dict[str, float | None] = {}
        for name in order:
            v = stamps.get(name)
            if v is None:
                clean[name] = None
                continue
            v = max(v, prev)
            clean[name] = v
            prev = v
        if clean.get("weights_loaded") is not None and clean.get("healthy") is not None:
            clean["weights_loaded"] = min(clean["weights_loaded"], clean["healthy"])  # type: ignore[type-var]
        try:
            rec = StartRecord(
                endpoint=self.spec.name,
                variant=r.variant,
                replica=r.id,
                node=r.node,
                revision=r.revision,
                event_class=event_class,
                scheduled=scheduled,
                weights_ready=clean["weights_ready"],
                runtime_started=clean["runtime_started"],
                weights_loaded=clean["weights_loaded"],
                healthy=clean["healthy"],
                first_response=clean["first_response"],
                weights_source=weights_source,
                bytes_from={k: v for k, v in bytes_from.items() if v},
                restart_count=r.restarts,
                failure=failure,
            )
            self.events.append(rec)  # the hook exports it to self.metrics
        except ValueError as exc:
            self.say(f"could not record the start of {r.id}: {exc}")

    async def _unroute(self, r: _Replica) -> None:
        if r.routed:
            r.routed = False
            with contextlib.suppress(ControlError):
                await self.router.remove(r.variant, r.url)

    async def _drain(self, r: _Replica) -> None:
        """Out of the router first, then wait for in-flight requests, then stop."""
        if r.task is not None and not r.task.done() and not r.routed:
            r.task.cancel()
        if r.routed:
            with contextlib.suppress(ControlError):
                await self.router.drain(r.variant, r.url)
            await self._wait_idle(r)
        await self._kill_replica(r)
        self._wake.set()

    async def _wait_idle(self, r: _Replica) -> None:
        """Until the router reports no request in flight to this replica (or
        DRAIN_TIMEOUT): the router counts requests it has sent but not finished, which
        the engine alone cannot see."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_TIMEOUT
        while loop.time() < deadline and r.child is not None and r.child.running:
            try:
                config = await self.router.get_config()
            except ControlError:
                return
            busy = 0
            for v in config.get("variants", []):
                for inst in v.get("instances", []):
                    if isinstance(inst, dict) and inst.get("url") == r.url:
                        busy = int(inst.get("in_flight", 0))
            if busy == 0:
                return
            await asyncio.sleep(0.05)

    async def _kill_replica(self, r: _Replica) -> None:
        """Stop the process, leave the router, release the lease; the replica is gone."""
        r.stopping = True
        if r.task is not None and r.task is not asyncio.current_task() and not r.task.done():
            r.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await r.task
        await self._unroute(r)
        if r.child is not None:
            await r.child.stop()
        if r.lease is not None:
            node = self.nodes[r.node]
            with contextlib.suppress(PreheatError, OSError):
                await asyncio.to_thread(node.cache.release, r.lease)
            r.lease = None
        r.phase = "stopped"
        self.replicas.pop(r.id, None)

    # --- helpers --------------------------------------------------------------------

    def _node(self, name: str) -> _Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise ControlError(
                f"no node {name!r}; nodes: {', '.join(self.nodes)} "
                "(add one with `preheat node add NAME`)"
            ) from None

    def _variant_spec(self, name: str | None) -> Any:
        if name is None:
            if len(self.spec.variants) != 1:
                raise ConfigError(
                    f"endpoint {self.spec.name!r} has variants "
                    f"{', '.join(v.name for v in self.spec.variants)}; name one with --variant"
                )
            return self.spec.variants[0]
        return self.spec.variant(name)

    def _describe_revisions(self) -> str:
        return ", ".join(
            f"{name} -> {rv.revision[:12]} ({format_size(rv.model_bytes)})"
            for name, rv in self.resolved.items()
        )
