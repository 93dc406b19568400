"""The local fleet on real processes: simulated engines, the real router, real node stores.

Models are a few MB and engines run at time-scale 0.01, so each scenario takes seconds;
the per-node origin bandwidth limit makes a "remote" download take about a second.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from preheat.runtime.local import LocalFleet
from preheat.store.store import NodeStore
from preheat.testing.fleet import (
    cluster_spec,
    endpoint_spec,
    make_model,
    make_new_revision,
    run_load,
    start_records,
)
from preheat.testing.origins import free_port, nginx_origin

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


@pytest.fixture
def model(tmp_path: Path):  # type: ignore[no-untyped-def]
    return make_model(tmp_path / "origin" / "m1", size=4 * MB, shards=4, seed=1)


def _target_ready(fleet: LocalFleet, revision: str) -> int:
    return sum(
        1
        for n in fleet.status()["nodes"]
        if n["target"] and n["cache"].get(revision, {}).get("state") == "ready"
    )


async def test_gate_holds_replicas_until_min_ready(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """No replica exists before minReady target nodes hold the revision; status says why."""
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True, "minReady": 2})
    # 4 MB at 3 MB/s: each warm-up takes over a second.
    cluster = cluster_spec(tmp_path, ["a", "b", "c"], bandwidth="3MB/s")
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        saw_waiting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while fleet.ready_count() < 2:
            assert loop.time() < deadline, fleet.status()
            st = fleet.status()
            rev = st["variants"][0]["revision"]
            if st["replicas"]:
                assert _target_ready(fleet, rev) >= 2, st
            elif st["variants"][0]["waiting"]:
                assert "cache gate" in st["variants"][0]["waiting"]
                saw_waiting = True
            await asyncio.sleep(0.02)
        assert saw_waiting
        recs = start_records(fleet.events.path)
        assert len(recs) == 2 and all(r.weights_source == "cache" for r in recs)
        assert all(r.bytes_from.get("origin", 0) == 0 for r in recs)


async def test_warm_nodes_preferred_cold_fallback_succeeds(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """With two warm nodes of one slot each, a third replica lands on a cold node, fetches
    from the origin itself (a recorded miss) and the deployment still succeeds."""
    spec = endpoint_spec(
        "chat", model.ref, replicas=3, cache={"enabled": True, "nodes": ["a", "b"]}
    )
    cluster = cluster_spec(tmp_path, ["a", "b", "c"], bandwidth="8MB/s", slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 3, 60, "three replicas")
        by_node = {r["node"]: r for r in fleet.status()["replicas"]}
        assert set(by_node) == {"a", "b", "c"}
        recs = {r.node: r for r in start_records(fleet.events.path)}
        assert recs["a"].weights_source == recs["b"].weights_source == "cache"
        assert recs["c"].weights_source == "origin"
        assert recs["c"].bytes_from["origin"] == fleet.status()["variants"][0]["model_bytes"]
        # The cold start waited for the download; the warm ones did not.
        assert recs["c"].stage_durations()["weights_ready"] > 0.3
        assert recs["a"].stage_durations()["weights_ready"] < 0.3
        # The router serves through all three.
        load = await run_load(fleet.router.url, requests=12, concurrency=3)
        assert load.failed == 0 and load.ok == 12
        # Each replica holds a lease on its node's snapshot while it runs.
        rev = fleet.status()["variants"][0]["revision"]
        for node, rep in by_node.items():
            assert NodeStore(tmp_path / "nodes" / node).leases(rev) == [rep["id"]]
    for node in by_node:  # stopped replicas released them
        assert NodeStore(tmp_path / "nodes" / node).leases(rev) == []


async def test_rollout_under_load_has_no_failed_request(tmp_path: Path, web_root: Path) -> None:
    """A one-shard version change rolls replicas while a bounded load runs: every request
    succeeds, only the changed shard is fetched, the old revision's cache is deleted."""
    model = make_model(web_root / "m1", size=4 * MB, shards=4, seed=1)
    m2 = make_new_revision(model, web_root / "m2", shard=1)
    root = web_root
    with nginx_origin(root) as origin:
        await _rollout(tmp_path, origin.base_url, root, model, m2)


async def _rollout(tmp_path: Path, base: str, root: Path, model, m2) -> None:  # type: ignore[no-untyped-def]
    spec = endpoint_spec("chat", model.http_ref(base, root), replicas=2, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a", "b"], bandwidth="8MB/s")
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        r1 = fleet.status()["variants"][0]["revision"]
        stop = asyncio.Event()
        load_task = asyncio.create_task(
            run_load(fleet.router.url, requests=2000, concurrency=4, timeout=60, stop=stop)
        )
        await asyncio.sleep(0.3)
        new = endpoint_spec("chat", m2.http_ref(base, root), replicas=2, cache={"enabled": True})
        await fleet.apply(new)
        r2 = fleet.status()["variants"][0]["revision"]
        assert r2 != r1
        await fleet.wait_until(
            lambda f: (
                f.status()["variants"][0]["stable"] == r2
                and f.ready_count(revision=r2) == 2
                and not any(n["cache"].get(r1) for n in f.status()["nodes"])
            ),
            60,
            "rollout to r2 and deletion of r1",
        )
        await asyncio.sleep(0.3)
        stop.set()
        load = await load_task
        assert load.ok > 20, load
        assert load.failed == 0, (load.errors[:5], [s for s in load.statuses if s != 200][:5])
        for node in ("a", "b"):
            store = NodeStore(tmp_path / "nodes" / node)
            assert store.has(r2) and not store.has(r1)
        shard = sorted(p for p in m2.dir.iterdir() if p.name.startswith("model-"))[1]
        # only the changed shard moves, and it crosses the origin once: the second node
        # takes it from the first (peers are on by default, docs/peers.md)
        assert fleet.fetched_bytes(r2) == shard.stat().st_size
        classes = {r.event_class.value for r in start_records(fleet.events.path)}
        assert "new_version" in classes


async def test_node_failure_replaced_on_other_node(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """Losing a node replaces its replica elsewhere; the start is a node-loss recovery."""
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a", "b", "c"], bandwidth="8MB/s", slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        victim = fleet.status()["replicas"][0]["node"]
        await fleet.fail_node(victim)
        await fleet.wait_until(
            lambda f: (
                f.ready_count() == 2 and victim not in {r["node"] for r in f.status()["replicas"]}
            ),
            60,
            "replacement replica",
        )
        nodes = {r["node"] for r in fleet.status()["replicas"]}
        assert len(nodes) == 2 and victim not in nodes
        recs = start_records(fleet.events.path)
        assert recs[-1].event_class.value == "node_loss_recovery"
        assert recs[-1].weights_source == "cache"  # c was warmed as a target
        load = await run_load(fleet.router.url, requests=10, concurrency=2)
        assert load.failed == 0
        # The node comes back: it is up again and the endpoint keeps serving.
        await fleet.add_node(victim)
        assert next(n for n in fleet.status()["nodes"] if n["name"] == victim)["up"]


async def test_new_node_is_warmed_and_scale_out_prefers_it(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """`node add` warms a new target node; a scale-out lands on warm nodes first."""
    spec = endpoint_spec("chat", model.ref, replicas=1, max_replicas=3, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a"], bandwidth="8MB/s", slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        rev = fleet.status()["variants"][0]["revision"]
        await fleet.add_node("d")
        await fleet.wait_until(lambda f: _target_ready(f, rev) == 2, 60, "node d warmed")
        await fleet.scale(2)
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        recs = start_records(fleet.events.path)
        assert recs[-1].node == "d" and recs[-1].weights_source == "cache"
        assert recs[-1].event_class.value == "new_node"
        with pytest.raises(ValueError, match=r"allows 1\.\.3 replicas, not 5"):
            await fleet.scale(5)


async def test_crashed_replica_restarted_and_counted(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """A replica process killed from outside is restarted on its node and counted."""
    spec = endpoint_spec("chat", model.ref, replicas=1, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a"])
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        (rep,) = fleet.replicas.values()
        assert rep.child is not None
        os.kill(rep.child.pid, signal.SIGKILL)
        await fleet.wait_until(
            lambda f: f.restarts_total == 1 and f.ready_count() == 1, 60, "restart"
        )
        st = fleet.status()
        assert st["restarts"] == 1 and st["replicas"][0]["restarts"] == 1
        assert st["replicas"][0]["id"] == rep.id
        last = start_records(fleet.events.path)[-1]
        assert last.event_class.value == "warm_restart" and last.restart_count == 1


async def test_small_node_reported_unfit_others_proceed(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """A node whose disk cannot hold the model is not ready, with the numbers; the
    deployment proceeds on the other nodes."""
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a", "b", "tiny"], overrides={"tiny": {"capacity": "1MB"}})
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        rev = fleet.status()["variants"][0]["revision"]
        tiny = next(n for n in fleet.status()["nodes"] if n["name"] == "tiny")
        entry = tiny["cache"][rev]
        assert entry["state"] == "unfit"
        assert "MB" in entry["reason"] or "MiB" in entry["reason"] or "bytes" in entry["reason"]
        assert {r["node"] for r in fleet.status()["replicas"]} <= {"a", "b"}


async def test_invalid_apply_rejected_endpoint_untouched(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """An apply that fails validation changes nothing: same replicas, same revision."""
    spec = endpoint_spec("chat", model.ref, replicas=1, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a"])
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        before = fleet.status()
        bad = endpoint_spec("chat", model.ref, replicas=1, cache={"enabled": True, "minReady": 3})
        with pytest.raises(ValueError, match="minReady 3 is above the 1 target nodes"):
            await fleet.apply(bad)
        other = endpoint_spec("other", model.ref)
        with pytest.raises(ValueError, match="this fleet runs 'chat'"):
            await fleet.apply(other)
        missing = endpoint_spec("chat", f"file://{tmp_path}/nowhere", cache={"enabled": True})
        with pytest.raises(Exception, match="nowhere"):
            await fleet.apply(missing)
        await asyncio.sleep(0.5)
        after = fleet.status()
        assert [r["id"] for r in after["replicas"]] == [r["id"] for r in before["replicas"]]
        assert after["variants"][0]["revision"] == before["variants"][0]["revision"]
        assert fleet.ready_count() == 1


async def test_origin_unreachable_waits_says_why_and_retries(
    tmp_path: Path, web_root: Path
) -> None:
    """With the origin down the deployment waits and status says why; once it is back
    the fleet resolves, warms and serves without being told."""
    model = make_model(web_root / "m1", size=2 * MB, shards=2, seed=3)
    port = free_port()
    spec = endpoint_spec(
        "chat", model.http_ref(f"http://127.0.0.1:{port}", web_root), cache={"enabled": True}
    )
    async with LocalFleet(spec, cluster_spec(tmp_path, ["a"]), tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.status()["resolving"] is not None, 30, "an error")
        why = fleet.status()["resolving"]
        assert f"127.0.0.1:{port}" in why and "retrying in" in why
        assert fleet.status()["replicas"] == []
        with nginx_origin(web_root, port=port):
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "the replica")
        assert fleet.status()["resolving"] is None


async def test_origin_lost_mid_warmup_node_failed_then_retried(tmp_path: Path) -> None:
    """An origin that vanishes during a warm-up marks the node failed with the reason;
    the warm-up is retried with backoff and succeeds once the origin is back."""
    model = make_model(tmp_path / "origin" / "m1", size=4 * MB, shards=16, seed=4)
    spec = endpoint_spec("chat", model.ref, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a"], bandwidth="1MB/s")
    moved = tmp_path / "origin" / "elsewhere"
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:

        def state(f: LocalFleet) -> dict[str, str]:
            nodes = f.status()["nodes"]
            return next(iter(nodes[0]["cache"].values()), {"state": "absent"})

        # Moved once bytes flow (before that the store would only fail to resolve it).
        await fleet.wait_until(
            lambda f: state(f)["state"] == "warming" and state(f).get("progress", [0])[0] > 0,
            30,
            "warming with bytes flowing",
        )
        model.dir.rename(moved)
        await fleet.wait_until(lambda f: state(f)["state"] == "failed", 60, "a failed warm-up")
        assert "disappeared from the origin" in state(fleet)["reason"]
        assert "retry 1" in state(fleet)["reason"]
        assert "cache gate" in fleet.status()["variants"][0]["waiting"]
        assert fleet.status()["replicas"] == []
        moved.rename(model.dir)
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "the replica")
        assert state(fleet)["state"] == "ready"


async def test_autoscaler_follows_in_flight_load(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """Sustained load above targetInFlight scales out onto warm nodes; when it stops the
    endpoint steps back in to replicas.min."""
    spec = endpoint_spec(
        "chat",
        model.ref,
        replicas=1,
        max_replicas=3,
        cache={"enabled": True},
        time_scale=1.0,
        autoscaling={"targetInFlight": 2, "scaleInBelow": 0.5, "cooldownSeconds": 1},
    )
    cluster = cluster_spec(tmp_path, ["a", "b", "c"], slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        stop = asyncio.Event()
        load = asyncio.create_task(
            run_load(
                fleet.router.url,
                requests=5000,
                concurrency=8,
                timeout=40,
                max_tokens=64,
                stop=stop,
            )
        )
        try:
            await fleet.wait_until(lambda f: f.ready_count() == 3, 40, "scale-out to 3")
        finally:
            stop.set()
            result = await load
        assert result.failed == 0, result.errors[:3]
        assert any("autoscale main" in m for m in fleet.messages)
        await fleet.wait_until(lambda f: f.replica_counts["main"] == 1, 30, "scale-in to 1")
        recs = start_records(fleet.events.path)
        assert [r.event_class.value for r in recs[1:3]] == ["scale_out", "scale_out"]
        assert all(r.weights_source == "cache" for r in recs)


async def test_engine_change_rolls_replicas_without_moving_weights(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """A new engine setting on the same model rolls every replica under load with no
    failed request, and no byte comes from the origin."""
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True})
    async with LocalFleet(spec, cluster_spec(tmp_path, ["a", "b"]), tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        first = {r["id"] for r in fleet.status()["replicas"]}
        spec_version = fleet.status()["variants"][0]["stable_version"]
        fetched = sum(fleet.origin_bytes.values())
        stop = asyncio.Event()
        load = asyncio.create_task(
            run_load(fleet.router.url, requests=2000, concurrency=3, timeout=60, stop=stop)
        )
        await fleet.apply(
            endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True}, time_scale=0.02)
        )
        await fleet.wait_until(
            lambda f: (
                f.ready_count() == 2
                and not first & {r["id"] for r in f.status()["replicas"]}
                and f.status()["variants"][0]["stable_version"] != spec_version
            ),
            60,
            "replicas replaced",
        )
        stop.set()
        result = await load
        assert result.failed == 0, result.errors[:3]
        assert sum(fleet.origin_bytes.values()) == fetched
        classes = [r.event_class.value for r in start_records(fleet.events.path)[2:]]
        assert classes == ["new_version", "new_version"]


async def test_failed_rollout_rolls_back_and_keeps_serving(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    """A new version whose replica cannot start is rolled back: the old replicas were never
    drained, the endpoint keeps serving, status shows the failed version."""
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True})
    async with LocalFleet(spec, cluster_spec(tmp_path, ["a", "b"]), tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        # Applied before the first rollout is even recorded as finished: the replicas that
        # serve are what it goes back to.
        stable = fleet.status()["replicas"][0]["revision"]
        first = sorted(r["id"] for r in fleet.status()["replicas"])
        broken = endpoint_spec(
            "chat",
            model.ref,
            replicas=2,
            cache={"enabled": True},
            engine={"command": "sh -c 'echo cannot start; exit 3' {port}"},
        )
        await fleet.apply(broken)
        await fleet.wait_until(
            lambda f: f.status()["variants"][0]["failed"], 60, "the rollout to fail"
        )
        await fleet.wait_until(
            lambda f: sorted(r["id"] for r in f.status()["replicas"]) == first, 30, "clean-up"
        )
        assert fleet.status()["variants"][0]["stable"] == stable
        assert any("rolling back" in m for m in fleet.messages)
        result = await run_load(fleet.router.url, requests=10, concurrency=2)
        assert result.failed == 0
        failed = [r for r in start_records(fleet.events.path) if r.failure]
        assert failed and "exited with code 3" in (failed[0].failure or "")
