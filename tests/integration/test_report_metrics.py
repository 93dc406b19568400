"""/metrics over real HTTP: start records via the log's hook, inventory refreshed per scrape."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from preheat.bench.models import generate_model
from preheat.store.store import NodeStore
from preheat.telemetry.events import EventLog
from preheat.telemetry.inventory import inventory_from_store
from preheat.telemetry.prometheus import TelemetryMetrics, serve_metrics
from preheat.testing.telemetry import synthetic_starts


async def test_metrics_endpoint_serves_starts_and_inventory(tmp_path: Path) -> None:
    """A scrape returns the start histograms and the store's current inventory gauges."""
    model = tmp_path / "model"
    generate_model(model, 128 * 1024, shards=2, seed=3)
    store = NodeStore(tmp_path / "store", capacity=32 * 1024**2, fsync=False)
    metrics = TelemetryMetrics()
    refreshes = 0

    def refresh() -> None:
        nonlocal refreshes
        refreshes += 1
        metrics.set_inventory([inventory_from_store("node-a", store)])

    records = synthetic_starts(12, seed=3)
    with EventLog(tmp_path / "events.jsonl", hooks=[metrics.observe_start]) as log:
        for r in records:
            log.append(r)
    async with (
        serve_metrics(metrics, refresh=refresh) as url,
        aiohttp.ClientSession() as session,
    ):
        assert url.startswith("http://127.0.0.1:")
        async with session.get(f"{url}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            first = await resp.text()
        pulled = await store.apull(f"file://{model}")
        async with session.get(f"{url}/metrics") as resp:
            second = await resp.text()
    assert refreshes == 2

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    a, b = samples(first), samples(second)
    assert a[("preheat_starts_total", (("event_class", "new_node"), ("outcome", "ok")))] == 2
    assert a[("preheat_node_snapshots", (("node", "node-a"),))] == 0
    assert b[("preheat_node_snapshots", (("node", "node-a"),))] == 1
    size = next(s.size for s in store.snapshots() if s.digest == pulled.manifest_digest)
    assert b[("preheat_node_used_bytes", (("node", "node-a"),))] == size
    assert b[("preheat_node_free_bytes", (("node", "node-a"),))] == store.free_bytes()
