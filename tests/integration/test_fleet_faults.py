"""Fleet faults on real processes: a changed origin, credentials in a failing origin's
URL, unexpected errors in the reconcile loop, node loss during a rollout, an origin down
during a scale-out (with a peer holding the revision, and without one).

Simulated engines at time-scale 0.01, the real router, real node stores on disk; HTTP
origins are nginx on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from preheat.bench.models import rewrite_shard
from preheat.clock import SystemClock
from preheat.runtime.control_api import ControlServer
from preheat.runtime.local import LocalFleet
from preheat.runtime.procs import free_port
from preheat.store.store import NodeStore
from preheat.testing.fleet import (
    cluster_spec,
    endpoint_spec,
    make_model,
    run_load,
    start_records,
)
from preheat.testing.origins import nginx_origin

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


USER, PASSWORD, SIG = "alice", "hunter2pw", "SIGSECRET123"


@contextlib.asynccontextmanager
async def _single_file_origin(port: int, size: int) -> AsyncIterator[None]:
    """An HTTP origin on 127.0.0.1:``port`` that answers HEAD for one file and 503 for
    every read of it (resolvable, never fetchable)."""

    async def head(request: web.Request) -> web.StreamResponse:
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": str(size), "ETag": '"v1"'})
        return web.Response(status=503, text="busy")

    app = web.Application()
    app.router.add_route("*", "/model.bin", head)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield
    finally:
        await runner.cleanup()


async def test_source_credentials_never_reach_status_metrics_events_or_log(
    tmp_path: Path,
) -> None:
    """An origin URL with ``user:password@`` and ``?sig=``, first unreachable, then
    resolvable but failing every read: /status, /metrics (the warm-up failure reason
    label), events.jsonl and the fleet log name the origin's host but hold neither
    credential."""
    port = free_port()
    source = f"http://{USER}:{PASSWORD}@127.0.0.1:{port}/model.bin?sig={SIG}"
    spec = endpoint_spec("chat", source, replicas=1, cache={"enabled": True})
    state = tmp_path / "state"
    async with LocalFleet(spec, cluster_spec(tmp_path, ["a"]), state) as fleet:
        control = ControlServer(fleet)
        await control.start()
        try:
            await fleet.wait_until(lambda f: f.status()["resolving"] is not None, 30, "an error")
            async with _single_file_origin(port, 1 * MB):

                def failed(f: LocalFleet) -> bool:
                    cache = f.status()["nodes"][0]["cache"]
                    return any(c["state"] == "failed" for c in cache.values())

                await fleet.wait_until(failed, 60, "a failed warm-up")
                async with aiohttp.ClientSession() as http:
                    auth = {"Authorization": f"Bearer {control.token}"}
                    async with http.get(f"{control.url}/status", headers=auth) as resp:
                        status_text = await resp.text()
                    async with http.get(f"{control.url}/metrics") as resp:
                        metrics_text = await resp.text()
        finally:
            await control.stop()
    log_text = (state / "logs" / "fleet.log").read_text()
    events_text = (state / "events.jsonl").read_text() if (state / "events.jsonl").exists() else ""
    texts = {"status": status_text, "metrics": metrics_text, "log": log_text}
    texts["events"] = events_text
    for name, text in texts.items():
        for secret in (PASSWORD, SIG, f"{USER}:"):
            assert secret not in text, f"{secret!r} in {name}"
    # Still useful: the reason names the origin, and the failure is a metrics label.
    assert f"127.0.0.1:{port}" in status_text and "503" in status_text
    assert "preheat_node_last_warmup_failure_timestamp_seconds{" in metrics_text
    assert "REDACTED" in metrics_text and f"127.0.0.1:{port}" in log_text


class _FaultyClock(SystemClock):
    """The system clock, except that ``now()`` raises once after ``arm()``."""

    def __init__(self) -> None:
        self.armed = False
        self.raised = 0

    def arm(self) -> None:
        self.armed = True

    def now(self) -> float:
        if self.armed:
            self.armed = False
            self.raised += 1
            raise RuntimeError("injected clock fault")
        return super().now()


async def test_unexpected_reconcile_error_logged_with_traceback_loop_keeps_running(
    tmp_path: Path,
) -> None:
    """An unexpected exception inside a reconcile pass (the injected clock raises) is
    written to the fleet log with its traceback, and the loop keeps reconciling: a
    scale-out asked for afterwards still happens."""
    model = make_model(tmp_path / "origin" / "m1", size=1 * MB, shards=1, seed=12)
    spec = endpoint_spec("chat", model.ref, replicas=1, max_replicas=2, cache={"enabled": True})
    clock = _FaultyClock()
    state = tmp_path / "state"
    async with LocalFleet(spec, cluster_spec(tmp_path, ["a"]), state, clock=clock) as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        clock.arm()
        await fleet.wait_until(lambda f: clock.raised == 1, 30, "the injected fault")
        await fleet.scale(2)
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "the scale-out")
        assert any("injected clock fault" in m for m in fleet.messages)
    log_text = (state / "logs" / "fleet.log").read_text()
    assert "Traceback (most recent call last)" in log_text
    assert "RuntimeError: injected clock fault" in log_text


async def test_node_loss_during_rollout_completes_on_remaining_nodes(tmp_path: Path) -> None:
    """A node lost while a version change rolls (new replicas starting, old ones serving
    under a bounded load): the rollout completes on the remaining nodes, nothing runs on
    the lost node, and the only failed requests are those that were in flight on the
    lost node's replica (at most the load's concurrency)."""
    model = make_model(tmp_path / "origin" / "m1", size=1 * MB, shards=1, seed=13)
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a", "b", "c"], slots=2)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        old_version = fleet.status()["variants"][0]["stable_version"]
        old_ids = {r["id"] for r in fleet.status()["replicas"]}
        stop = asyncio.Event()
        concurrency = 4
        load_task = asyncio.create_task(
            run_load(
                fleet.router.url, requests=3000, concurrency=concurrency, timeout=90, stop=stop
            )
        )
        await asyncio.sleep(0.3)
        # An engine change: a new version, rolled without moving weights.
        new = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True}, time_scale=0.02)
        await fleet.apply(new)

        def rolling(f: LocalFleet) -> bool:
            return any(r["id"] not in old_ids for r in f.status()["replicas"])

        await fleet.wait_until(rolling, 60, "a new-version replica")
        # Lose the node of a serving old replica, mid-rollout.
        victim = next(r["node"] for r in fleet.status()["replicas"] if r["id"] in old_ids)
        config = await fleet.router.get_config()
        on_victim = {
            r["url"] for r in fleet.status()["replicas"] if r["node"] == victim and r["url"]
        }
        in_flight = sum(
            int(i.get("in_flight", 0))
            for v in config["variants"]
            for i in v["instances"]
            if i["url"] in on_victim
        )
        await fleet.fail_node(victim)

        def done(f: LocalFleet) -> bool:
            st = f.status()
            return (
                st["variants"][0]["stable_version"] not in (None, old_version)
                and f.ready_count() == 2
                and all(r["id"] not in old_ids for r in st["replicas"])
            )

        await fleet.wait_until(done, 90, "the rollout to finish on the remaining nodes")
        await asyncio.sleep(0.3)
        stop.set()
        load = await load_task
        st = fleet.status()
        assert victim not in {r["node"] for r in st["replicas"]}
        assert {r["phase"] for r in st["replicas"]} == {"ready"}
        assert load.ok > 20, load
        assert load.failed <= concurrency, (load.failed, in_flight, load.errors[:5])
        bad = [c for c in load.statuses if c != 200]
        print(
            f"node loss mid-rollout: {load.ok} ok, {load.failed} failed "
            f"(statuses {bad}, errors {load.errors[:3]}), {in_flight} in flight just before"
        )


async def test_origin_down_scale_out_fills_from_the_peer_that_holds_the_revision(
    tmp_path: Path, web_root: Path
) -> None:
    """A scale-out onto a cold node while the origin is down: node a holds the revision,
    so the new replica fills from a's peer server against the manifest the fleet pinned
    (every byte verified), starts without the origin, and records ``peer`` bytes; the
    serving replica is untouched."""
    model = make_model(web_root / "m1", size=1 * MB, shards=2, seed=14)
    port = free_port()
    spec = endpoint_spec(
        "chat",
        model.http_ref(f"http://127.0.0.1:{port}", web_root),
        replicas=1,
        max_replicas=2,
        cache={"enabled": True, "nodes": ["a"]},
    )
    cluster = cluster_spec(tmp_path, ["a", "b"], slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        with nginx_origin(web_root, port=port):
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        # The origin is down now; the second replica can only go to the cold node b.
        await fleet.scale(2)
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "the scaled-out replica")
        load = await run_load(fleet.router.url, requests=10, concurrency=2)
        assert load.failed == 0
        recs = [r for r in start_records(fleet.events.path) if r.node == "b"]
        assert len(recs) == 1 and recs[0].failure is None
        assert recs[0].weights_source == "peer" and not recs[0].cache_hit
        assert recs[0].bytes_from["peer"] == model.size
        assert recs[0].bytes_from.get("origin", 0) == 0
        assert fleet.nodes["b"].cache.store.verify(quarantine=False).ok


async def test_origin_down_scale_out_without_a_peer_holder_waits_for_the_origin(
    tmp_path: Path, web_root: Path
) -> None:
    """The only node holding the revision is lost while the origin is down: its
    replacement on a cold node has no peer to fill from, so it waits (status says the
    origin fetch failed and when it retries) and starts from the origin once it is
    back."""
    model = make_model(web_root / "m1", size=1 * MB, shards=2, seed=15)
    port = free_port()
    spec = endpoint_spec(
        "chat",
        model.http_ref(f"http://127.0.0.1:{port}", web_root),
        replicas=1,
        max_replicas=2,
        cache={"enabled": True, "nodes": ["a"]},
    )
    cluster = cluster_spec(tmp_path, ["a", "b"], slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        with nginx_origin(web_root, port=port):
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
        await fleet.fail_node("a")  # the origin is down and no up node holds the model

        def waiting(f: LocalFleet) -> dict[str, Any] | None:
            for r in f.status()["replicas"]:
                if r["node"] == "b" and "origin fetch failed" in r["detail"]:
                    return dict(r)
            return None

        await fleet.wait_until(lambda f: waiting(f) is not None, 60, "the waiting replica")
        rep = waiting(fleet)
        assert rep is not None and rep["phase"] == "starting" and "retrying in" in rep["detail"]
        assert f"127.0.0.1:{port}" in rep["detail"]
        assert fleet.ready_count() == 0
        with nginx_origin(web_root, port=port):
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "the replacement")
        recs = [r for r in start_records(fleet.events.path) if r.node == "b"]
        assert recs and recs[-1].weights_source == "origin" and recs[-1].failure is None
        assert recs[-1].bytes_from["origin"] == model.size
