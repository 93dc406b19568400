"""Live warm-ups: the origin budget holds with peers off, and a warm-up never evicts
another warm-up's copy that no replica has used yet (the simulator's fixes, live)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from preheat.control.spec import parse_cluster, parse_endpoint
from preheat.runtime.local import LocalFleet
from preheat.testing.fleet import endpoint_spec, make_model
from preheat.testing.origins import nginx_origin

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


def _views(fleet: LocalFleet, rev: str) -> list[dict[str, Any]]:
    return [n["cache"].get(rev, {}) for n in fleet.status()["nodes"]]


async def test_peers_off_warm_ups_take_turns_for_the_origin_budget(tmp_path: Path) -> None:
    """With ``peers.enabled: false`` and ``concurrentFills: 1``, three nodes warm one at a
    time (the others say they wait for an origin slot); each still gets its own copy."""
    model = make_model(tmp_path / "origin" / "m", size=6 * MB, shards=2, seed=21)
    spec = endpoint_spec("chat", model.ref, replicas=0, cache={"enabled": True})
    nodes = [{"name": f"n{i}", "capacity": "1GiB", "slots": 1} for i in range(3)]
    cluster = parse_cluster(
        {
            "nodes": nodes,
            "peers": {"enabled": False},
            "origin": {"bandwidth": "6MB/s", "budget": {"concurrentFills": 1}},
        },
        base_dir=tmp_path,
    )
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "resolve")
        rev = fleet.status()["variants"][0]["revision"]
        most_filling = 0
        waited = False

        def done(f: LocalFleet) -> bool:
            nonlocal most_filling, waited
            views = _views(f, rev)
            filling = [v for v in views if v.get("state") == "warming" and not v.get("reason")]
            most_filling = max(most_filling, len(filling))
            waited |= any("origin slot" in v.get("reason", "") for v in views)
            return all(v.get("state") == "ready" for v in views)

        await fleet.wait_until(done, 90, "every node warm")
        assert most_filling == 1
        assert waited
        assert fleet.warmer.peers is None
        size = fleet.status()["variants"][0]["model_bytes"]
        assert {n: fleet.origin_bytes[(n, rev)] for n in fleet.nodes} == dict.fromkeys(
            fleet.nodes, size
        )


async def test_a_warm_up_never_evicts_a_warmed_copy_no_replica_used(tmp_path: Path) -> None:
    """One node that holds one of two models: the second warm-up waits (``failed``, the
    reason says why, retried) instead of evicting the first copy and starting a cycle of
    evict and re-warm; a replica of the second model still evicts the first as before,
    and the node's view of the first then stops saying ``ready``."""
    a = make_model(tmp_path / "origin" / "a", size=6 * MB, shards=2, seed=22)
    b = make_model(tmp_path / "origin" / "b", size=6 * MB, shards=2, seed=23)
    with nginx_origin(tmp_path / "origin") as origin:
        doc: dict[str, Any] = {
            "name": "chat",
            "engine": {"simulated": {"profile": "tiny", "time_scale": 0.01}},
            "replicas": {"min": 0, "max": 2},
            "variants": [
                {
                    "name": "a",
                    "model": {"source": a.http_ref(origin.base_url, tmp_path / "origin")},
                    "weight": 1,
                },
                {
                    "name": "b",
                    "model": {"source": b.http_ref(origin.base_url, tmp_path / "origin")},
                    "weight": 1,
                },
            ],
            "modelCacheConfig": {"weights": {"enabled": True, "timeoutSeconds": 3}},
        }
        cluster = parse_cluster(
            {
                "nodes": [{"name": "n0", "capacity": "9MB", "slots": 2}],
                "origin": {"budget": {"concurrentFills": 1}},
            },
            base_dir=tmp_path,
        )
        async with LocalFleet(parse_endpoint(doc), cluster, tmp_path / "state") as fleet:

            def revs(f: LocalFleet) -> list[str]:
                return [v["revision"] for v in f.status()["variants"]]

            await fleet.wait_until(lambda f: all(revs(f)), 30, "resolve")
            ra, rb = revs(fleet)

            def one_warm_one_waiting(f: LocalFleet) -> bool:
                views = [_views(f, r)[0] for r in (ra, rb)]
                return sorted(v.get("state", "absent") for v in views) == [
                    "failed",
                    "ready",
                ] and any("no replica has used yet" in v.get("reason", "") for v in views)

            await fleet.wait_until(one_warm_one_waiting, 60, "one copy kept, the other waiting")
            kept = ra if _views(fleet, ra)[0]["state"] == "ready" else rb
            await asyncio.sleep(3.0)  # a few retries (backoff 1, 2 s)
            assert _views(fleet, kept)[0]["state"] == "ready"
            size = fleet.status()["variants"][0]["model_bytes"]
            assert sum(fleet.origin_bytes.values()) == size  # nothing evicted and fetched again
            other = "b" if kept == ra else "a"
            await fleet.scale(1, variant=other)
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "the other model's replica")
            store = fleet.nodes["n0"].cache
            assert not store.has(kept)  # the replica's own pull evicted the unused copy
            assert _views(fleet, kept)[0].get("state") != "ready"  # and the view says so
