"""The node agent's Prometheus metrics (served on ``/metrics`` beside the inventory's)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from preheat.telemetry.prometheus import TelemetryMetrics

__all__ = ["AgentMetrics"]


class AgentMetrics:
    """The agent's counters and gauges, in the registry of its ``TelemetryMetrics``."""

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
