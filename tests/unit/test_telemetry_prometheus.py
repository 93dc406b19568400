"""Prometheus export: histograms per stage and class, cache counters, inventory gauges."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from preheat.telemetry.events import EventClass
from preheat.telemetry.inventory import NodeInventory, SnapshotEntry, WarmupFailure
from preheat.telemetry.prometheus import TelemetryMetrics
from preheat.testing.telemetry import synthetic_starts


def samples(metrics: TelemetryMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(s: dict, name: str, **labels: str) -> float:
    return s[(name, tuple(sorted(labels.items())))]


def test_start_records_become_histograms_and_counters() -> None:
    """Counts per stage/class, hit/miss counters and bytes by source match the records."""
    records = synthetic_starts(24, seed=5, failures=1)
    m = TelemetryMetrics()
    for r in records:
        m.observe_start(r)
    s = samples(m)
    for cls in EventClass:
        mine = [r for r in records if r.event_class is cls]
        n_stage = sum(1 for r in mine if "weights_ready" in r.stage_durations())
        assert (
            value(
                s, "preheat_start_stage_seconds_count", stage="weights_ready", event_class=cls.value
            )
            == n_stage
        )
        total = sum(r.stage_durations()["weights_ready"] for r in mine)
        assert (
            abs(
                value(
                    s,
                    "preheat_start_stage_seconds_sum",
                    stage="weights_ready",
                    event_class=cls.value,
                )
                - total
            )
            < 1e-6
        )
        ok = sum(1 for r in mine if r.ok)
        assert value(s, "preheat_start_ready_seconds_count", event_class=cls.value) == ok
        hits = sum(1 for r in mine if r.cache_hit)
        if hits:
            assert (
                value(s, "preheat_weights_cache_total", result="hit", event_class=cls.value) == hits
            )
        if len(mine) - hits:
            assert (
                value(s, "preheat_weights_cache_total", result="miss", event_class=cls.value)
                == len(mine) - hits
            )
    assert (
        value(
            s, "preheat_starts_total", event_class=records[-1].event_class.value, outcome="failed"
        )
        == 1
    )
    origin = sum(r.bytes_from.get("origin", 0) for r in records)
    assert value(s, "preheat_weights_bytes_total", source="origin") == origin
    pulls = sum(1 for r in records if r.image_source == "pull")
    assert value(s, "preheat_image_cache_total", result="miss") == pulls


def test_registries_are_private() -> None:
    """Two TelemetryMetrics never share counters and the global registry stays untouched."""
    a, b = TelemetryMetrics(), TelemetryMetrics()
    a.observe_start(synthetic_starts(1)[0])
    assert b"preheat_starts_total{" not in b.exposition()
    assert b"preheat_starts_total{" in a.exposition()
    assert REGISTRY.get_sample_value("preheat_starts_total") is None


def test_route_decisions_counted_with_tokens() -> None:
    """Decisions count per instance; predicted, actual and prompt tokens add up."""
    m = TelemetryMetrics()
    rows = [
        {
            "variant": "main",
            "strategy": "prefix_aware",
            "instance": f"i{k % 2}",
            "outcome": "ok",
            "decision_us": 5.0 + k,
            "predicted_cached_tokens": 32 * k,
            "actual_cached_tokens": None if k == 3 else 16 * k,
            "prompt_tokens": 100,
        }
        for k in range(6)
    ]
    for r in rows:
        m.observe_route(r)
    s = samples(m)
    assert (
        value(
            s,
            "preheat_route_decisions_total",
            variant="main",
            strategy="prefix_aware",
            instance="i0",
            outcome="ok",
        )
        == 3
    )
    lab = {"variant": "main", "strategy": "prefix_aware"}
    assert value(s, "preheat_route_predicted_cached_tokens_total", **lab) == 32 * 15
    assert value(s, "preheat_route_actual_cached_tokens_total", **lab) == 16 * (15 - 3)
    assert value(s, "preheat_route_prompt_tokens_total", **lab) == 600
    assert value(s, "preheat_route_decision_seconds_count", strategy="prefix_aware") == 6
    # decision_us were 5..10: one at <= 5 us, all six at <= 10 us, the sum in seconds.
    hist = {"strategy": "prefix_aware"}
    assert value(s, "preheat_route_decision_seconds_bucket", le="5e-06", **hist) == 1
    assert value(s, "preheat_route_decision_seconds_bucket", le="1e-05", **hist) == 6
    assert value(s, "preheat_route_decision_seconds_bucket", le="+Inf", **hist) == 6
    assert abs(value(s, "preheat_route_decision_seconds_sum", **hist) - 45e-6) < 1e-12


def test_inventory_gauges_follow_the_latest_inventory() -> None:
    """Gauges report the last inventory; a node that vanished stops being exported."""
    m = TelemetryMetrics()
    inv = [
        NodeInventory(
            "node-a",
            free_bytes=1000,
            snapshots=(
                SnapshotEntry(
                    "rev-1", 400, last_use=1.7e9, pinned=True, priority=2, leased_by=("r0", "r1")
                ),
            ),
            eviction_candidates=(),
            ready={"rev-1": True},
        ),
        NodeInventory(
            "node-b", free_bytes=50, last_warmup_failure=WarmupFailure("rev-1", "disk full", 1.7e9)
        ),
    ]
    m.set_inventory(inv)
    s = samples(m)
    assert value(s, "preheat_node_free_bytes", node="node-a") == 1000
    assert value(s, "preheat_node_used_bytes", node="node-a") == 400
    assert value(s, "preheat_node_snapshot_leases", node="node-a", revision="rev-1") == 2
    assert value(s, "preheat_node_snapshot_pinned", node="node-a", revision="rev-1") == 1
    assert value(s, "preheat_node_snapshot_priority", node="node-a", revision="rev-1") == 2
    assert value(s, "preheat_node_revision_ready", node="node-a", revision="rev-1") == 1
    assert value(s, "preheat_node_warmup_failures", node="node-b") == 1
    m.set_inventory(inv[:1])
    assert ("preheat_node_free_bytes", (("node", "node-b"),)) not in samples(m)
