"""Telemetry of the live fleet: its /metrics scraped over HTTP and parsed back, and the
``new_node`` class for nodes that join while the endpoint is still coming up.

Real processes throughout (simulated engines at time-scale 0.01, the real router, real
node stores on disk, a bandwidth-limited origin).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from preheat.runtime.control_api import ControlServer
from preheat.runtime.local import LocalFleet
from preheat.telemetry.events import EventClass
from preheat.telemetry.prometheus import CONTENT_TYPE_LATEST
from preheat.testing.fleet import cluster_spec, endpoint_spec, make_model, start_records

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


async def test_fleet_metrics_scrape_matches_events_and_status(tmp_path: Path) -> None:
    """The control API's /metrics, parsed back: start histograms per class and stage equal
    what events.jsonl holds, cache and byte counters add up, and the per-node inventory
    gauges equal the inventory and readiness in the status document (including a node
    whose warm-up failed, with its reason)."""
    model = make_model(tmp_path / "origin" / "m1", size=2 * MB, shards=2, seed=5)
    spec = endpoint_spec("chat", model.ref, replicas=2, max_replicas=3, cache={"enabled": True})
    cluster = cluster_spec(
        tmp_path, ["a", "b", "tiny"], bandwidth="8MB/s", overrides={"tiny": {"capacity": "1MB"}}
    )
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        control = ControlServer(fleet)
        await control.start()
        try:
            await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
            await fleet.scale(3)
            await fleet.wait_until(lambda f: f.ready_count() == 3, 60, "three replicas")
            victim = next(iter(fleet.replicas.values()))
            assert victim.child is not None
            os.kill(victim.child.pid, signal.SIGKILL)
            await fleet.wait_until(
                lambda f: f.restarts_total == 1 and f.ready_count() == 3, 60, "restart"
            )
            auth = {"Authorization": f"Bearer {control.token}"}
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{control.url}/status", headers=auth) as resp:
                    assert resp.status == 200
                    st: dict[str, Any] = await resp.json()
                async with http.get(f"{control.url}/metrics") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
                    samples = _parse(await resp.text())
            records = start_records(fleet.events.path)
            assert fleet.events.hook_errors == 0
        finally:
            await control.stop()

    # Starts: one histogram sample per record and stage, per class.
    assert len(records) == st["starts"] + st["restarts"] == 4
    classes = Counter(r.event_class for r in records)
    assert classes[EventClass.WARM_RESTART] == 1 and classes[EventClass.SCALE_OUT] == 1
    for cls in EventClass:
        n = classes.get(cls, 0)
        ok = sum(1 for r in records if r.event_class is cls and r.ok)
        if n == 0:
            assert ("preheat_start_ready_seconds_count", (("event_class", cls.value),)) not in (
                samples
            )
            continue
        assert _get(samples, "preheat_start_ready_seconds_count", event_class=cls.value) == ok
        assert _get(samples, "preheat_starts_total", event_class=cls.value, outcome="ok") == ok
        for stage in ("weights_ready", "runtime_started", "healthy", "first_response"):
            with_stage = sum(
                1 for r in records if r.event_class is cls and stage in r.stage_durations()
            )
            got = _get(
                samples, "preheat_start_stage_seconds_count", stage=stage, event_class=cls.value
            )
            assert got == with_stage, (cls, stage)
    hits = sum(1 for r in records if r.cache_hit)
    got_hits = sum(
        v
        for labels, v in _series(samples, "preheat_weights_cache_total").items()
        if ("result", "hit") in labels
    )
    assert got_hits == hits == len(records)  # warm nodes only
    cache_bytes = sum(r.bytes_from.get("cache", 0) for r in records)
    assert _get(samples, "preheat_weights_bytes_total", source="cache") == cache_bytes > 0

    # Inventory gauges equal the status document's inventory and readiness.
    rev = st["variants"][0]["revision"]
    by_node = {n["node"]: n for n in st["inventory"]}
    assert set(by_node) == {"a", "b", "tiny"}
    replicas_on: Counter[str] = Counter(r["node"] for r in st["replicas"])
    for node in st["nodes"]:
        name = node["name"]
        inv = by_node[name]
        assert _get(samples, "preheat_node_free_bytes", node=name) == inv["free_bytes"]
        assert _get(samples, "preheat_node_used_bytes", node=name) == inv["used_bytes"]
        assert _get(samples, "preheat_node_snapshots", node=name) == len(inv["snapshots"])
        ready = node["cache"].get(rev, {}).get("state") == "ready"
        assert inv["ready"].get(rev) is ready
        assert _get(samples, "preheat_node_revision_ready", node=name, revision=rev) == int(ready)
        for snap in inv["snapshots"]:
            key = {"node": name, "revision": snap["revision"]}
            assert _get(samples, "preheat_node_snapshot_bytes", **key) == snap["size_bytes"]
            leases = _get(samples, "preheat_node_snapshot_leases", **key)
            assert leases == len(snap["leased_by"]) == replicas_on[name]
            assert sorted(snap["leased_by"]) == sorted(
                r["id"] for r in st["replicas"] if r["node"] == name
            )
    # The small node: not ready, its failure and reason both in status and /metrics.
    tiny = by_node["tiny"]
    assert tiny["snapshots"] == [] and tiny["last_warmup_failure"] is not None
    assert tiny["last_warmup_failure"]["revision"] == rev
    status_reason = next(n for n in st["nodes"] if n["name"] == "tiny")["cache"][rev]["reason"]
    assert tiny["last_warmup_failure"]["reason"] in status_reason
    assert _get(samples, "preheat_node_warmup_failures", node="tiny") == 1
    assert _get(samples, "preheat_node_warmup_failures", node="a") == 0
    (failure,) = _series(samples, "preheat_node_last_warmup_failure_timestamp_seconds").items()
    labels = dict(failure[0])
    assert labels["node"] == "tiny" and labels["revision"] == rev
    assert labels["reason"] == tiny["last_warmup_failure"]["reason"][:200]
    assert failure[1] == pytest.approx(tiny["last_warmup_failure"]["at"])


async def test_node_added_during_startup_is_new(tmp_path: Path) -> None:
    """A node that joins while the endpoint is still coming up (cache gate open, no replica
    healthy yet) and one that joins after the first replica is healthy both count as
    ``new_node`` on their first start; a node from the cluster file never does."""
    model = make_model(tmp_path / "origin" / "m1", size=4 * MB, shards=4, seed=2)
    cache = {"enabled": True, "nodes": ["a"], "minReady": 1}
    spec = endpoint_spec("chat", model.ref, replicas=1, max_replicas=4, cache=cache)
    cluster = cluster_spec(tmp_path, ["a", "b"], bandwidth="4MB/s", slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        # Node a warms for about a second before the gate opens: add d meanwhile.
        await fleet.add_node("d")
        assert fleet.ready_count() == 0 and not fleet.replicas
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "first replica")
        model_bytes = fleet.status()["variants"][0]["model_bytes"]
        await fleet.scale(2)
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "second replica")
        await fleet.add_node("e")
        await fleet.scale(3)
        await fleet.wait_until(lambda f: f.ready_count() == 3, 60, "third replica")
        await fleet.scale(4)
        await fleet.wait_until(lambda f: f.ready_count() == 4, 60, "fourth replica")
        records = start_records(fleet.events.path)

    by_node = {r.node: r for r in records}
    assert len(records) == 4 and set(by_node) == {"a", "b", "d", "e"}
    assert by_node["a"].event_class is EventClass.COLD_POD_WARM_NODE
    # Scale-outs: d and e are new (cold, so they read the model from the origin); b, from
    # the cluster file, is a plain scale-out even though it never hosted a replica.
    assert by_node["d"].event_class is EventClass.NEW_NODE
    assert by_node["e"].event_class is EventClass.NEW_NODE
    assert by_node["b"].event_class is EventClass.SCALE_OUT
    for name in ("b", "d", "e"):
        assert by_node[name].weights_source == "origin"
        assert by_node[name].bytes_from["origin"] == model_bytes
