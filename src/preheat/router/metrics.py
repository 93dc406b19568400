"""The router's Prometheus metrics, in their own registry (one per router)."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Decision time in seconds: 5 us to 10 ms.
DECISION_BUCKETS = (5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2)


class RouterMetrics:
    """Requests, in-flight, decisions by outcome, decision time, upstream errors, health."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "preheat_router_requests",
            "Requests proxied, by variant and instance",
            ["variant", "instance"],
            registry=r,
        )
        self.in_flight = Gauge(
            "preheat_router_in_flight",
            "Requests in flight, by variant and instance",
            ["variant", "instance"],
            registry=r,
        )
        self.decisions = Counter(
            "preheat_router_decisions",
            "Routing decisions by outcome (affinity, spill, fallback, hint, random, ...)",
            ["variant", "strategy", "outcome"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "preheat_router_decision_seconds",
            "Time the policy took to choose an instance",
            ["variant"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
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
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """A cached labelled child (label lookups cost microseconds on the hot path)."""
        key = (metric._name, *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def forget(self, variant: str, instance: str) -> None:
        """Stop exporting series of an instance that left."""
        for m in (self.requests, self.in_flight, self.healthy):
            with contextlib.suppress(KeyError):
                m.remove(variant, instance)
        self._children = {
            k: v for k, v in self._children.items() if not (len(k) >= 3 and k[2] == instance)
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
