"""The router's Prometheus metrics, in their own registry (one per router).

What changes on every request (requests, decisions by outcome, decision time) is kept
as plain integers in dicts and turned into metric families only when ``/metrics`` is
scraped (``_HotCollector``); in-flight counts are read from the instances at scrape
time. A prometheus_client child costs a lock and a few calls per update, ~1 us each;
these cost a dict update. Rare events (upstream errors, health, rejections) keep
prometheus_client objects.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

KV_EVENT_STATES = ("waiting", "synced", "fallback")
# Decision time in seconds: 5 us to 10 ms.
DECISION_BUCKETS = (5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2)


class _HotCollector(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        m = self.m
        req = CounterMetricFamily(
            "preheat_router_requests",
            "Requests proxied, by variant and instance",
            labels=["variant", "instance"],
        )
        for (v, i), n in list(m.requests.items()):
            req.add_metric([v, i], n)
        yield req
        dec = CounterMetricFamily(
            "preheat_router_decisions",
            "Routing decisions by outcome (affinity, spill, fallback, hint, random, ...)",
            labels=["variant", "strategy", "outcome"],
        )
        for (v, st, o), n in list(m.decisions.items()):
            dec.add_metric([v, st, o], n)
        yield dec
        hist = HistogramMetricFamily(
            "preheat_router_decision_seconds",
            "Time the policy took to choose an instance",
            labels=["variant"],
        )
        for v, (counts, total_us) in list(m.decision_hist.items()):
            cum, buckets = 0, []
            for le, c in zip(m.bucket_labels, counts, strict=True):
                cum += c
                buckets.append((le, cum))
            hist.add_metric([v], buckets, sum_value=total_us / 1e6)
        yield hist
        inf = GaugeMetricFamily(
            "preheat_router_in_flight",
            "Requests in flight, by variant and instance",
            labels=["variant", "instance"],
        )
        if m.in_flight_source is not None:
            for v, i, n in m.in_flight_source():
                inf.add_metric([v, i], n)
        yield inf
        if m.kv_events_source is not None:
            yield from _kv_event_families(m.kv_events_source())


def _kv_event_families(status: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """The precise KV index per instance (router/kvprecise.py), at scrape time."""
    st = GaugeMetricFamily(
        "preheat_router_kv_events_state",
        "1 for the KV-event state of the instance: synced (the router routes on its "
        "events), fallback (gap, disconnect or silence: the learned index decides until "
        "AllBlocksCleared or a restarted publisher) or waiting (nothing received yet)",
        labels=["instance", "state"],
    )
    blocks = GaugeMetricFamily(
        "preheat_router_kv_events_blocks",
        "Blocks the instance announced as held (BlockStored minus BlockRemoved)",
        labels=["instance"],
    )
    gaps = CounterMetricFamily(
        "preheat_router_kv_events_gaps",
        "Sequence gaps seen in the instance's KV-event stream",
        labels=["instance"],
    )
    for inst, s in status.items():
        for name in KV_EVENT_STATES:
            st.add_metric([inst, name], 1.0 if s["state"] == name else 0.0)
        blocks.add_metric([inst], s["blocks"])
        gaps.add_metric([inst], s["gaps"])
    yield st
    yield blocks
    yield gaps


class RouterMetrics:
    """Requests, in-flight, decisions by outcome, decision time, upstream errors, health.

    ``in_flight_source`` yields ``(variant, instance, in_flight)`` at scrape time.
    """

    def __init__(
        self, in_flight_source: Callable[[], Iterable[tuple[str, str, int]]] | None = None
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.in_flight_source = in_flight_source
        # Per instance with KV events: its precise index status (set by the router).
        self.kv_events_source: Callable[[], dict[str, dict[str, Any]]] | None = None
        self.requests: dict[tuple[str, str], int] = {}
        self.decisions: dict[tuple[str, str, str], int] = {}
        # Per variant: counts per bucket (the last is +Inf) and the sum in microseconds.
        self.decision_hist: dict[str, tuple[list[int], float]] = {}
        self._bounds_us = [b * 1e6 for b in DECISION_BUCKETS]
        self.bucket_labels = [*(floatToGoString(b) for b in DECISION_BUCKETS), "+Inf"]
        r.register(_HotCollector(self))
        self.upstream_errors = Counter(
            "preheat_router_upstream_errors",
            "Upstream failures by kind (connect, timeout, stream, status)",
            ["variant", "instance", "kind"],
            registry=r,
        )
        self.healthy = Gauge(
            "preheat_router_instance_healthy",
            "1 if the instance takes traffic, 0 if unhealthy or draining",
            ["variant", "instance"],
            registry=r,
        )
        self.rejected = Counter(
            "preheat_router_rejected",
            "Requests answered by the router itself, by HTTP status",
            ["status"],
            registry=r,
        )
        self.kv_capacity = Gauge(
            "preheat_router_kv_capacity_tokens",
            "KV-cache capacity the instance's engine reports (vllm:cache_config_info "
            "block_size x num_gpu_blocks, or llama.cpp context x slots)",
            ["variant", "instance"],
            registry=r,
        )
        self.decision_log_dropped = Counter(
            "preheat_router_decision_log_dropped",
            "Decision-log records dropped because the write failed (disk full, I/O error)",
            registry=r,
        )
        self._children: dict[tuple[str, ...], Any] = {}

    def observe(self, variant: str, strategy: str, outcome: str, instance: str, us: float) -> None:
        """Count one routed request: its decision's outcome and time, and its instance."""
        k = (variant, strategy, outcome)
        d = self.decisions
        d[k] = d.get(k, 0) + 1
        r = self.requests
        ki = (variant, instance)
        r[ki] = r.get(ki, 0) + 1
        h = self.decision_hist.get(variant)
        if h is None:
            h = self.decision_hist[variant] = ([0] * (len(DECISION_BUCKETS) + 1), 0.0)
        h[0][bisect_left(self._bounds_us, us)] += 1
        self.decision_hist[variant] = (h[0], h[1] + us)

    def child(self, metric: Any, *labels: str) -> Any:
        """A cached labelled child (label lookups cost microseconds on the hot path)."""
        key = (metric._name, *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def forget(self, variant: str, instance: str) -> None:
        """Stop exporting series of an instance that left."""
        self.requests.pop((variant, instance), None)
        with contextlib.suppress(KeyError):
            self.healthy.remove(variant, instance)
        with contextlib.suppress(KeyError):
            self.kv_capacity.remove(variant, instance)
        self._children = {
            k: v for k, v in self._children.items() if not (len(k) >= 3 and k[2] == instance)
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
