"""Prometheus export of start records, routing decisions and cache inventory.

Everything lives in one ``CollectorRegistry`` owned by a ``TelemetryMetrics`` object (never
the process-global registry), so two fleets or two tests in one process never share
counters, and ``exposition()`` returns exactly this fleet's ``/metrics`` body.

Metrics (all prefixed ``preheat_``):

- ``start_stage_seconds{stage,event_class}``     histogram, one sample per recorded stage
- ``start_ready_seconds{event_class}``            histogram, scheduled -> healthy, good starts
- ``starts_total{event_class,outcome}``          counter, outcome ``ok`` or ``failed``
- ``weights_cache_total{result,event_class}``    counter, result ``hit`` (weights on the node) or
                                                  ``miss`` (read from a peer or the origin)
- ``image_cache_total{result}``                  counter, ``hit`` (cache) or ``miss`` (pull)
- ``weights_bytes_total{source}``                counter, bytes read per source
- ``route_decisions_total{variant,strategy,instance,outcome}``   counter
- ``route_decision_seconds{strategy}``           histogram of the policy's decision time
- ``route_{predicted,actual}_cached_tokens_total{variant,strategy}`` and
  ``route_prompt_tokens_total{variant,strategy}``: the router's predicted prefix hit vs the
  engine's reported ``cached_tokens``; their ratio to prompt tokens is the KV hit rate
- inventory gauges (read at scrape time from the last ``set_inventory``):
  ``node_free_bytes{node}``, ``node_used_bytes{node}``, ``node_snapshots{node}``,
  ``node_snapshot_bytes{node,revision}``, ``node_snapshot_pinned{node,revision}``,
  ``node_snapshot_leases{node,revision}``, ``node_snapshot_priority{node,revision}``,
  ``node_snapshot_last_use_timestamp_seconds{node,revision}``,
  ``node_revision_ready{node,revision}`` (1 ready, 0 not), ``node_eviction_candidates{node}``,
  ``node_warmup_failures{node}`` (1 while the last warm-up of the node failed),
  ``node_last_warmup_failure_timestamp_seconds{node,revision,reason}`` (when it failed,
  and why; one series per failing node, the reason cut to 200 characters)

``observe_route`` is on every routed request, so its counters are plain integers under one
lock, turned into metric families at scrape time (see ``_RouteCollector``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from bisect import bisect_left
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from preheat.artifacts.refs import redact_url
from preheat.telemetry.events import StartRecord
from preheat.telemetry.inventory import NodeInventory

__all__ = [
    "CONTENT_TYPE_LATEST",
    "START_BUCKETS",
    "TelemetryMetrics",
    "metrics_app",
    "serve_metrics",
]

#: Start-time buckets: sub-second warm restarts up to hour-long cold pulls of large models.
START_BUCKETS: tuple[float, ...] = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
)
#: Routing decision time buckets in microseconds (exported in seconds), 1 us .. 10 ms.
DECISION_BUCKETS_US: tuple[float, ...] = (
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    10000.0,
)


class _InventoryCollector(Collector):
    def __init__(self) -> None:
        self.inventory: tuple[NodeInventory, ...] = ()

    def collect(self) -> Iterator[Metric]:
        inv = self.inventory
        free = GaugeMetricFamily(
            "preheat_node_free_bytes", "Free bytes in the node store", labels=["node"]
        )
        used = GaugeMetricFamily(
            "preheat_node_used_bytes", "Bytes held by snapshots", labels=["node"]
        )
        count = GaugeMetricFamily(
            "preheat_node_snapshots", "Snapshots in the node store", labels=["node"]
        )
        evict = GaugeMetricFamily(
            "preheat_node_eviction_candidates",
            "Snapshots the store would evict next to get under its watermark",
            labels=["node"],
        )
        failing = GaugeMetricFamily(
            "preheat_node_warmup_failures",
            "1 while the last warm-up on the node failed (reason in the inventory), else 0",
            labels=["node"],
        )
        failure = GaugeMetricFamily(
            "preheat_node_last_warmup_failure_timestamp_seconds",
            "When the node's last warm-up failed (epoch seconds); the reason is a label",
            labels=["node", "revision", "reason"],
        )
        snap_labels = ["node", "revision"]
        size = GaugeMetricFamily("preheat_node_snapshot_bytes", "Snapshot size", labels=snap_labels)
        pinned = GaugeMetricFamily(
            "preheat_node_snapshot_pinned", "1 if pinned", labels=snap_labels
        )
        leases = GaugeMetricFamily(
            "preheat_node_snapshot_leases", "Replicas holding a lease", labels=snap_labels
        )
        prio = GaugeMetricFamily(
            "preheat_node_snapshot_priority", "Eviction priority", labels=snap_labels
        )
        last_use = GaugeMetricFamily(
            "preheat_node_snapshot_last_use_timestamp_seconds",
            "Last use of the snapshot, epoch seconds",
            labels=snap_labels,
        )
        ready = GaugeMetricFamily(
            "preheat_node_revision_ready",
            "1 when the controller marked the revision ready on the node",
            labels=snap_labels,
        )
        for node in inv:
            free.add_metric([node.node], node.free_bytes)
            used.add_metric([node.node], node.used_bytes)
            count.add_metric([node.node], len(node.snapshots))
            evict.add_metric([node.node], len(node.eviction_candidates))
            failing.add_metric([node.node], 0 if node.last_warmup_failure is None else 1)
            if node.last_warmup_failure is not None:
                f = node.last_warmup_failure
                # Redacted before the cut, so a cut never leaves half a credential.
                reason = redact_url(f.reason)[:200]
                failure.add_metric([node.node, f.revision, reason], f.at)
            for s in node.snapshots:
                key = [node.node, s.revision]
                size.add_metric(key, s.size_bytes)
                pinned.add_metric(key, 1 if s.pinned else 0)
                leases.add_metric(key, len(s.leased_by))
                prio.add_metric(key, s.priority)
                if s.last_use is not None:
                    last_use.add_metric(key, s.last_use)
            for revision, is_ready in node.ready.items():
                ready.add_metric([node.node, revision], 1 if is_ready else 0)
        yield from (free, used, count, evict, failing, failure)
        yield from (size, pinned, leases, prio, last_use, ready)


class _RouteStats:
    __slots__ = ("actual", "buckets", "count", "predicted", "prompt", "us_sum")

    def __init__(self) -> None:
        self.count = 0
        self.predicted = 0
        self.actual = 0
        self.prompt = 0
        self.us_sum = 0.0
        self.buckets = [0] * (len(DECISION_BUCKETS_US) + 1)


class _RouteCollector(Collector):
    """Routing counters kept as plain integers and turned into metrics at scrape time.

    ``prometheus_client`` children take a lock and validate per call; a routed request
    would pay that five times. Here one dict lookup and a few integer additions under one
    uncontended lock do the same, and the scrape aggregates.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str, str, str], _RouteStats] = {}

    def observe(
        self,
        key: tuple[str, str, str, str],
        decision_us: float,
        predicted: int | None,
        actual: int | None,
        prompt: int | None,
    ) -> None:
        i = bisect_left(DECISION_BUCKETS_US, decision_us)
        with self._lock:
            st = self._stats.get(key)
            if st is None:
                st = self._stats[key] = _RouteStats()
            st.count += 1
            st.us_sum += decision_us
            st.buckets[i] += 1
            if predicted:
                st.predicted += predicted
            if actual:
                st.actual += actual
            if prompt:
                st.prompt += prompt

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = [
                (k, (v.count, v.predicted, v.actual, v.prompt, v.us_sum, list(v.buckets)))
                for k, v in self._stats.items()
            ]
        decisions = CounterMetricFamily(
            "preheat_route_decisions",
            "Routing decisions by chosen instance and outcome",
            labels=["variant", "strategy", "instance", "outcome"],
        )
        toks: dict[tuple[str, str], list[int]] = {}
        hist: dict[str, tuple[list[int], float]] = {}
        for key, (count, pred, act, prompt, us_sum, buckets) in items:
            decisions.add_metric(list(key), count)
            t = toks.setdefault((key[0], key[1]), [0, 0, 0])
            t[0] += pred
            t[1] += act
            t[2] += prompt
            h = hist.get(key[1])
            if h is None:
                hist[key[1]] = (buckets, us_sum)
            else:
                hist[key[1]] = ([a + b for a, b in zip(h[0], buckets, strict=True)], h[1] + us_sum)
        yield decisions
        names = (
            (
                "preheat_route_predicted_cached_tokens",
                "Prompt tokens the router expected the chosen instance to have cached",
            ),
            (
                "preheat_route_actual_cached_tokens",
                "Prompt tokens the engine reported as cached (usage.prompt_tokens_details)",
            ),
            ("preheat_route_prompt_tokens", "Prompt tokens of routed requests"),
        )
        for j, (name, doc) in enumerate(names):
            fam = CounterMetricFamily(name, doc, labels=["variant", "strategy"])
            for (variant, strategy), t in toks.items():
                fam.add_metric([variant, strategy], t[j])
            yield fam
        seconds = HistogramMetricFamily(
            "preheat_route_decision_seconds",
            "Time the routing policy took to choose",
            labels=["strategy"],
        )
        for strategy, (buckets, us_sum) in hist.items():
            cum = 0
            out = []
            for bound, n in zip((*DECISION_BUCKETS_US, math.inf), buckets, strict=True):
                cum += n
                out.append(("+Inf" if bound == math.inf else repr(bound / 1e6), cum))
            seconds.add_metric([strategy], out, us_sum / 1e6)
        yield seconds


class TelemetryMetrics:
    """The Prometheus side of telemetry, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.stage_seconds = Histogram(
            "preheat_start_stage_seconds",
            "Seconds spent in each start stage, per event class",
            ["stage", "event_class"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self.ready_seconds = Histogram(
            "preheat_start_ready_seconds",
            "Seconds from scheduled to healthy, per event class",
            ["event_class"],
            buckets=START_BUCKETS,
            registry=r,
        )
        self.starts = Counter(
            "preheat_starts", "Replica starts", ["event_class", "outcome"], registry=r
        )
        self.weights_cache = Counter(
            "preheat_weights_cache",
            "Starts whose weights were on the node (hit) or fetched (miss)",
            ["result", "event_class"],
            registry=r,
        )
        self.image_cache = Counter(
            "preheat_image_cache",
            "Starts whose image was cached (hit) or pulled (miss)",
            ["result"],
            registry=r,
        )
        self.weights_bytes = Counter(
            "preheat_weights_bytes",
            "Weight bytes read during starts, by source",
            ["source"],
            registry=r,
        )
        self._inventory = _InventoryCollector()
        r.register(self._inventory)
        self._routes = _RouteCollector()
        r.register(self._routes)

    # --- starts ---------------------------------------------------------------------------

    def observe_start(self, record: StartRecord) -> None:
        """Count one start and observe its stage times."""
        cls = record.event_class.value
        for stage, seconds in record.stage_durations().items():
            self.stage_seconds.labels(stage, cls).observe(seconds)
        ready = record.ready_seconds
        if record.ok and ready is not None:
            self.ready_seconds.labels(cls).observe(ready)
        self.starts.labels(cls, "ok" if record.ok else "failed").inc()
        self.weights_cache.labels("hit" if record.cache_hit else "miss", cls).inc()
        if record.image_source is not None:
            self.image_cache.labels("hit" if record.image_source == "cache" else "miss").inc()
        for source, n in record.bytes_from.items():
            if n:
                self.weights_bytes.labels(source).inc(n)

    # --- routing --------------------------------------------------------------------------

    def observe_route(self, decision: Any) -> None:
        """Count one routing decision (a ``RouteDecision`` or a dict with its keys)."""
        if isinstance(decision, dict):
            key = (
                decision["variant"],
                decision["strategy"],
                decision["instance"] or "",
                decision["outcome"],
            )
            us = decision["decision_us"]
            predicted = decision.get("predicted_cached_tokens")
            actual = decision.get("actual_cached_tokens")
            prompt = decision.get("prompt_tokens")
        else:
            key = (decision.variant, decision.strategy, decision.instance or "", decision.outcome)
            us = decision.decision_us
            predicted = decision.predicted_cached_tokens
            actual = decision.actual_cached_tokens
            prompt = decision.prompt_tokens
        self._routes.observe(key, us, predicted, actual, prompt)

    # --- inventory ------------------------------------------------------------------------

    def set_inventory(self, inventory: list[NodeInventory] | tuple[NodeInventory, ...]) -> None:
        """Replace the inventory the gauges report (nodes that vanished stop being exported)."""
        self._inventory.inventory = tuple(inventory)

    # --- exposition -----------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The ``/metrics`` body in the Prometheus text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


# --- serving ----------------------------------------------------------------------------------


def metrics_app(
    metrics: TelemetryMetrics, *, refresh: Callable[[], Awaitable[None] | None] | None = None
) -> web.Application:
    """An aiohttp app serving ``GET /metrics``; ``refresh`` runs before each scrape
    (for example to re-read the node inventory), sync or async."""

    async def handle(request: web.Request) -> web.Response:
        if refresh is not None:
            out = refresh()
            if inspect.isawaitable(out):
                await out
        return web.Response(
            body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", handle)
    return app


@contextlib.asynccontextmanager
async def serve_metrics(
    metrics: TelemetryMetrics,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    refresh: Callable[[], Awaitable[None] | None] | None = None,
) -> AsyncIterator[str]:
    """Serve ``/metrics`` while the block runs; yields the base URL (port 0 picks one)."""
    runner = web.AppRunner(metrics_app(metrics, refresh=refresh), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()
