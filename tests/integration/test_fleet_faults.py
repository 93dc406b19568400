"""Fleet faults on real processes: a changed origin, credentials in a failing origin's
URL, unexpected errors in the reconcile loop, node loss during a rollout, an origin down
during a scale-out.

Simulated engines at time-scale 0.01, the real router, real node stores on disk; HTTP
origins are nginx on 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.bench.models import rewrite_shard
from preheat.runtime.local import LocalFleet
from preheat.store.store import NodeStore
from preheat.testing.fleet import cluster_spec, endpoint_spec, make_model

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


def _stored_bytes(store: Path) -> int:
    """Bytes of blobs, snapshots and partial downloads under a node store."""
    return sum(
        p.stat().st_size
        for sub in ("blobs", "snapshots", "tmp")
        for p in (store / sub).rglob("*")
        if p.is_file() and not p.is_symlink()
    )


async def test_changed_file_origin_refused_before_any_byte(tmp_path: Path) -> None:
    """After a file:// origin changes under a pinned revision, a warm-up on a new node
    fetches 0 bytes and publishes no snapshot; the failure reason says the ref moved."""
    model = make_model(tmp_path / "origin" / "m1", size=2 * MB, shards=2, seed=11)
    spec = endpoint_spec("chat", model.ref, replicas=1, cache={"enabled": True})
    async with LocalFleet(spec, cluster_spec(tmp_path, ["a"]), tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        pinned = fleet.status()["variants"][0]["revision"]
        rewrite_shard(model.dir, 0, 77)  # the origin now serves another revision
        await fleet.add_node("b")
        store = tmp_path / "state" / "nodes" / "b"

        def view(f: LocalFleet) -> dict[str, str]:
            node = next(n for n in f.status()["nodes"] if n["name"] == "b")
            return dict(node["cache"].get(pinned, {"state": "absent"}))

        await fleet.wait_until(lambda f: view(f)["state"] == "failed", 60, "a refused warm-up")
        assert _stored_bytes(store) == 0
        assert NodeStore(store).snapshots() == []
        reason = view(fleet)["reason"]
        assert "now resolves to" in reason and pinned in reason, reason
        assert fleet.origin_bytes[("b", pinned)] == 0
        assert fleet.ready_count() == 1  # node a keeps serving what it pinned
