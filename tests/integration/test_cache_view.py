"""A local node's cache view follows its store: a copy evicted from under the fleet (a
second model's fill in a small store) stops being ``ready`` within one tick, and the
fleet warms it again, instead of counting a copy the store no longer holds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from preheat.control.spec import parse_cluster
from preheat.runtime.local import LocalFleet
from preheat.store import NodeStore
from preheat.testing.fleet import endpoint_spec, make_model

pytestmark = pytest.mark.timeout(60)

MB = 1_000_000


def _view(fleet: LocalFleet, rev: str) -> dict[str, Any]:
    return dict(fleet.status()["nodes"][0]["cache"].get(rev, {}))


async def test_a_copy_evicted_by_another_fill_leaves_ready_within_a_tick(tmp_path: Path) -> None:
    """A warmed copy evicted by another model's pull into the same small store (9 MB, two
    6 MB models) leaves ``ready`` in status and the inventory within one tick; the fleet
    fills it again once b's fill no longer holds the room (its warm-up meanwhile is
    ``unfit`` and retried, not given up); the old view said ``ready`` for as long as the
    fleet ran."""
    a = make_model(tmp_path / "origin" / "a", size=6 * MB, shards=2, seed=31)
    b = make_model(tmp_path / "origin" / "b", size=6 * MB, shards=2, seed=32)
    spec = endpoint_spec("chat", a.ref, replicas=0, cache={"enabled": True})
    cluster = parse_cluster(
        {"nodes": [{"name": "n0", "capacity": "9MB", "slots": 1, "origin_bandwidth": "6MB/s"}]},
        base_dir=tmp_path,
    )
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "resolve")
        rev = fleet.status()["variants"][0]["revision"]
        await fleet.wait_until(lambda f: _view(f, rev).get("state") == "ready", 30, "warm")
        node = fleet.nodes["n0"]
        first = fleet.origin_bytes[("n0", rev)]
        # Another user of the node's store (as `preheat cache pull --store ... --capacity`).
        other = NodeStore(node.spec.store, capacity=node.spec.capacity)
        # b's fill evicts a's copy first, then fills for about 1 s (6 MB at 6 MB/s).
        pulling = asyncio.create_task(asyncio.to_thread(other.pull, b.ref, rate_limit=6 * MB))
        while other.has(rev):
            await asyncio.sleep(0.01)
        evicted = time.monotonic()
        await fleet.wait_until(lambda f: _view(f, rev).get("state") != "ready", 1.0, "not ready")
        # One tick is 0.2 s; the status poll adds up to 0.05 s.
        assert time.monotonic() - evicted < 0.6
        pulled = await pulling
        assert fleet.inventory()[0].to_dict()["ready"].get(rev) is not True
        assert any("no longer in its store" in m for m in fleet.status()["messages"])
        await fleet.wait_until(lambda f: _view(f, rev).get("state") == "ready", 30, "warm again")
        assert other.has(rev) and not other.has(pulled.revision)
        assert any("n0 cannot hold" in m for m in fleet.status()["messages"])  # b's room
        assert first >= a.size and fleet.origin_bytes[("n0", rev)] == 2 * first
