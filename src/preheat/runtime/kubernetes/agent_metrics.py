"""The node agent's Prometheus metrics (served on ``/metrics`` beside the inventory's).

``preheat_agent_bytes_fetched_total{source}`` counts the weight bytes the agent's
warm-ups fetched, by where they came from: ``origin`` or ``peer`` (summed over
``source`` it is the total, as before the label). A warm-up counts its bytes once, with
``FetchedBytes.inc`` after its pull; a warm-up through the agent's peers
(``agent_peers``) first says how many of them came from peers (``FetchedBytes.peer``,
found for the registry with ``fetched_bytes``), and those are counted as ``peer``. Once
every warm-up's pull has been counted, each source's total is exact.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge

from preheat.telemetry.prometheus import TelemetryMetrics

__all__ = ["AgentMetrics", "FetchedBytes", "fetched_bytes"]

_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, FetchedBytes] = (
    weakref.WeakKeyDictionary()
)


class FetchedBytes:
    """``preheat_agent_bytes_fetched_total{source="origin"|"peer"}`` (module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "preheat_agent_bytes_fetched",
            "Weight bytes the agent's warm-ups fetched, by source (origin or peer)",
            ["source"],
            registry=registry,
        )
        for source in ("origin", "peer"):
            self.counter.labels(source)
        self._peer_pending = 0
        _BY_REGISTRY[registry] = self

    def peer(self, n: int) -> None:
        """``n`` bytes of a warm-up about to be counted (``inc``) came from peers."""
        self._peer_pending += max(0, n)

    def inc(self, n: int) -> None:
        """A warm-up's pull fetched ``n`` bytes: the part said to be from peers is
        ``peer``, the rest ``origin``."""
        peer = min(max(0, n), self._peer_pending)
        self._peer_pending -= peer
        if peer:
            self.counter.labels("peer").inc(peer)
        if n - peer > 0:
            self.counter.labels("origin").inc(n - peer)


def fetched_bytes(registry: CollectorRegistry) -> FetchedBytes | None:
    """The ``FetchedBytes`` of the agent whose metrics live in ``registry``, if any."""
    return _BY_REGISTRY.get(registry)


class AgentMetrics:
    """The agent's counters and gauges, in the registry of its ``TelemetryMetrics``."""

    def __init__(self) -> None:
        self.telemetry = TelemetryMetrics()
        r = self.telemetry.registry
        self.fetched = FetchedBytes(r)
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
