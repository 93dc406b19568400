"""Start telemetry from the live local fleet: every event class for its scenario, cache
labels with real byte counts, and a report built from what the fleet wrote.

One fleet runs the whole story on real processes (simulated engines at time-scale 0.01,
the real router, real node stores on disk, a bandwidth-limited origin):

initial deploy on a warm node -> scale-out -> replica killed and restarted in place ->
its node fails -> a node joins and the endpoint scales onto it -> a one-shard version
change rolls every replica.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from preheat.runtime.local import LocalFleet
from preheat.telemetry.events import EventClass, StartRecord
from preheat.telemetry.inventory import NodeInventory, WarmupFailure, inventory_from_store
from preheat.telemetry.prometheus import TelemetryMetrics
from preheat.telemetry.report import write_report
from preheat.testing.fleet import (
    cluster_spec,
    endpoint_spec,
    make_model,
    make_new_revision,
    start_records,
)

pytestmark = pytest.mark.timeout(240)

MB = 1_000_000


def _new(fleet: LocalFleet, seen: int) -> list[StartRecord]:
    return start_records(fleet.events.path)[seen:]


def _inventory(fleet: LocalFleet) -> list[NodeInventory]:
    out = []
    for name, node in fleet.nodes.items():
        if not node.up:
            continue
        failure = None
        for rev, view in node.views.items():
            if view.reason and view.state != "ready":
                failure = WarmupFailure(rev, view.reason, 0.0)
        out.append(
            inventory_from_store(
                name,
                node.cache.store,
                capacity_bytes=node.spec.capacity,
                ready={rev: view.state == "ready" for rev, view in node.views.items()},
                last_warmup_failure=failure,
            )
        )
    return out


async def test_each_event_class_from_its_scenario(tmp_path: Path) -> None:
    """Six scenarios, six classes; warm starts read 0 origin bytes, cold ones the model."""
    model = make_model(tmp_path / "origin" / "m1", size=4 * MB, shards=4, seed=1)
    m2 = make_new_revision(model, tmp_path / "origin" / "m2", shard=1)
    cache = {"enabled": True, "nodes": ["a", "b"], "minReady": 1}
    spec = endpoint_spec("chat", model.ref, replicas=1, max_replicas=4, cache=cache)
    cluster = cluster_spec(tmp_path, ["a", "b", "c"], bandwidth="8MB/s", slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        # 1. Initial deployment lands on a warm target node.
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        (first,) = _new(fleet, 0)
        assert first.event_class is EventClass.COLD_POD_WARM_NODE
        assert first.node in ("a", "b")
        assert first.weights_source == "cache" and first.bytes_from.get("origin", 0) == 0
        st = fleet.status()
        model_bytes = st["revisions"][st["variants"][0]["revision"]]["bytes"]
        assert first.bytes_from["cache"] == model_bytes
        seen = 1

        # 2. Scale-out: the other warm node.
        await fleet.scale(2)
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        (rec,) = _new(fleet, seen)
        seen += 1
        assert rec.event_class is EventClass.SCALE_OUT
        assert rec.weights_source == "cache" and rec.bytes_from.get("origin", 0) == 0

        # 3. The first replica's process dies; it is restarted on its node.
        rep = fleet.replicas[first.replica]
        assert rep.child is not None
        os.kill(rep.child.pid, signal.SIGKILL)
        await fleet.wait_until(
            lambda f: f.restarts_total == 1 and f.ready_count() == 2, 60, "restart"
        )
        (rec,) = _new(fleet, seen)
        seen += 1
        assert rec.event_class is EventClass.WARM_RESTART
        assert rec.replica == first.replica and rec.node == first.node
        assert rec.restart_count == 1

        # 4. Its node fails: the replacement lands on c, a cold node, and fetches the model.
        await fleet.fail_node(first.node)
        await fleet.wait_until(
            lambda f: (
                f.ready_count() == 2
                and first.node not in {r["node"] for r in f.status()["replicas"]}
            ),
            60,
            "replacement replica",
        )
        (rec,) = _new(fleet, seen)
        seen += 1
        assert rec.event_class is EventClass.NODE_LOSS_RECOVERY
        assert rec.node == "c"
        assert rec.weights_source == "origin"
        assert rec.bytes_from["origin"] == model_bytes

        # 5. A node joins after deployment; scaling out places a replica on it: its first
        # start is new_node (a node added by `node add` is new until it hosts a replica).
        r1 = st["variants"][0]["revision"]
        await fleet.wait_until(
            lambda f: f.status()["variants"][0]["stable"] == r1, 30, "deployment finished"
        )
        await fleet.add_node("d")
        await fleet.scale(3)
        await fleet.wait_until(lambda f: f.ready_count() == 3, 60, "three replicas")
        (rec,) = _new(fleet, seen)
        seen += 1
        assert rec.event_class is EventClass.NEW_NODE
        assert rec.node == "d"
        assert rec.weights_source == "origin" and rec.bytes_from["origin"] == model_bytes

        # 6. A version change: every new replica is a new_version start.
        await fleet.add_node("e")
        await fleet.apply(endpoint_spec("chat", m2.ref, replicas=1, max_replicas=4, cache=cache))
        r2 = fleet.status()["variants"][0]["revision"]
        assert r2 != r1
        await fleet.wait_until(
            lambda f: f.status()["variants"][0]["stable"] == r2 and f.ready_count(revision=r2) == 3,
            90,
            "rollout to the new revision",
        )
        rolled = [r for r in _new(fleet, seen) if r.revision == r2]
        assert len(rolled) >= 3
        assert {r.event_class for r in rolled} == {EventClass.NEW_VERSION}

        records = start_records(fleet.events.path)
        inventory = _inventory(fleet)

    # Every class appeared, each start is healthy and labelled.
    assert {r.event_class for r in records} == set(EventClass)
    assert all(r.ok for r in records), [r.failure for r in records if not r.ok]
    for r in records:
        if r.weights_source == "cache":
            assert r.bytes_from.get("origin", 0) == 0
        assert r.scheduled <= (r.weights_ready or r.scheduled) <= (r.healthy or 0)

    # Prometheus export of the same records.
    metrics = TelemetryMetrics()
    for r in records:
        metrics.observe_start(r)
    metrics.set_inventory(inventory)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(metrics.exposition().decode())
        for s in fam.samples
    }
    origin = sum(r.bytes_from.get("origin", 0) for r in records)
    assert samples[("preheat_weights_bytes_total", (("source", "origin"),))] == origin
    for cls in EventClass:
        n = sum(1 for r in records if r.event_class is cls)
        key = ("preheat_start_ready_seconds_count", (("event_class", cls.value),))
        assert samples[key] == n
    assert any(name == "preheat_node_snapshot_bytes" for name, _ in samples)

    # And the report from what the fleet wrote.
    index = write_report(records, tmp_path / "report", inventory=inventory)
    page = index.read_text()
    for cls in EventClass:
        assert f'data-class="{cls.value}"' in page
    assert (tmp_path / "report" / "inventory.png").is_file()
    assert (tmp_path / "report" / "readiness_cdf.png").is_file()
