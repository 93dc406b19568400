"""The node agent's ``preheat_agent_bytes_fetched_total{source}``: peer and origin bytes
apart, read back from the agent registry's Prometheus exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from preheat.runtime.kubernetes.agent_metrics import AgentMetrics, fetched_bytes


def _by_source(m: AgentMetrics) -> dict[str, float]:
    text = generate_latest(m.telemetry.registry).decode()
    return {
        s.labels["source"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "preheat_agent_bytes_fetched_total"
    }


def test_peer_part_of_a_pull_is_counted_as_peer_the_rest_as_origin() -> None:
    """A peer warm-up says its peer bytes before its pull is counted; a plain pull after
    it counts as origin only; both series exist from the start, and their sum is the
    total the unlabelled counter used to have."""
    m = AgentMetrics()
    assert _by_source(m) == {"origin": 0.0, "peer": 0.0}
    found = fetched_bytes(m.telemetry.registry)
    assert found is m.fetched
    found.peer(700)
    m.fetched.inc(1000)  # 700 from peers, 300 from the origin
    m.fetched.inc(50)  # a pull without peers
    assert _by_source(m) == {"origin": 350.0, "peer": 700.0}
    assert sum(_by_source(m).values()) == 1050


def test_a_registry_without_agent_metrics_has_no_fetched_bytes() -> None:
    """``fetched_bytes`` finds only the registry an ``AgentMetrics`` created."""
    assert fetched_bytes(CollectorRegistry()) is None
