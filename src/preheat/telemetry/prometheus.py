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
  ``node_warmup_failures{node}`` (1 while the last warm-up of the node failed)

Hot paths (``observe_start``, ``observe_route``) cache labelled children in plain dicts:
``labels()`` validates and locks on each call, which would dominate a per-request budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from preheat.telemetry.events import StartRecord
from preheat.telemetry.inventory import NodeInventory

__all__ = ["CONTENT_TYPE_LATEST", "START_BUCKETS", "TelemetryMetrics"]

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
#: Routing decision time buckets, 1 us .. 10 ms.
DECISION_BUCKETS: tuple[float, ...] = (
    1e-6,
    2.5e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    1e-2,
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
        yield from (free, used, count, evict, failing, size, pinned, leases, prio, last_use, ready)


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj[name]
    return getattr(obj, name)


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
        self.route_decisions = Counter(
            "preheat_route_decisions",
            "Routing decisions by chosen instance and outcome",
            ["variant", "strategy", "instance", "outcome"],
            registry=r,
        )
        self.route_decision_seconds = Histogram(
            "preheat_route_decision_seconds",
            "Time the routing policy took to choose",
            ["strategy"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        tok_labels = ["variant", "strategy"]
        self.route_predicted = Counter(
            "preheat_route_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen instance to have cached",
            tok_labels,
            registry=r,
        )
        self.route_actual = Counter(
            "preheat_route_actual_cached_tokens",
            "Prompt tokens the engine reported as cached (usage.prompt_tokens_details)",
            tok_labels,
            registry=r,
        )
        self.route_prompt = Counter(
            "preheat_route_prompt_tokens",
            "Prompt tokens of routed requests",
            tok_labels,
            registry=r,
        )
        self._inventory = _InventoryCollector()
        r.register(self._inventory)
        self._route_children: dict[tuple[str, str, str, str], Any] = {}
        self._tok_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._decision_children: dict[str, Any] = {}

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
        """Count one routing decision (a ``RouteDecision`` or a mapping with its keys)."""
        variant = _get(decision, "variant")
        strategy = _get(decision, "strategy")
        key = (variant, strategy, _get(decision, "instance") or "", _get(decision, "outcome"))
        child = self._route_children.get(key)
        if child is None:
            child = self._route_children[key] = self.route_decisions.labels(*key)
        child.inc()
        hist = self._decision_children.get(strategy)
        if hist is None:
            hist = self._decision_children[strategy] = self.route_decision_seconds.labels(strategy)
        hist.observe(_get(decision, "decision_us") / 1e6)
        toks = self._tok_children.get((variant, strategy))
        if toks is None:
            toks = self._tok_children[(variant, strategy)] = (
                self.route_predicted.labels(variant, strategy),
                self.route_actual.labels(variant, strategy),
                self.route_prompt.labels(variant, strategy),
            )
        predicted = _get(decision, "predicted_cached_tokens")
        actual = _get(decision, "actual_cached_tokens")
        prompt = _get(decision, "prompt_tokens")
        if predicted:
            toks[0].inc(predicted)
        if actual:
            toks[1].inc(actual)
        if prompt:
            toks[2].inc(prompt)

    # --- inventory ------------------------------------------------------------------------

    def set_inventory(self, inventory: list[NodeInventory] | tuple[NodeInventory, ...]) -> None:
        """Replace the inventory the gauges report (nodes that vanished stop being exported)."""
        self._inventory.inventory = tuple(inventory)

    # --- exposition -----------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The ``/metrics`` body in the Prometheus text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
