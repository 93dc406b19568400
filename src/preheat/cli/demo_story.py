"""`preheat demo`'s story: the whole of it on one machine in a few minutes (``run_demo``).

1. Generate a sample model (safetensors shards of random bytes) and a second revision
   that changes one shard, served by a local HTTP origin (Range requests); every node
   downloads from it at a limited bandwidth, like a remote bucket.
2. A 3-node local fleet starts one replica *without* the cache on a fleet where no node
   holds the model yet: with no peer to fill from, it downloads the model from the
   origin itself (a real cold start; a cold replica reads from peers once any node holds
   the revision, see docs/peers.md).
3. The cache is switched on: target nodes are warmed, the gate opens, and a scale-out
   lands on warm nodes (warm starts). Readiness per stage, cold vs warm.
4. A version change: the new revision is warmed (only the changed shard moves), replicas
   roll one by one, the old revision's cache is deleted.
5. A 4th node joins, is warmed, and a scale-out lands on it.
6. The same traffic (RAG-style prompts over shared documents with skewed popularity)
   with ``random`` and with ``prefix_aware`` routing: TTFT, KV hit rate, shares.

It writes ``DIR/events.jsonl`` (one start record per replica start), the router's
sampled decision log ``DIR/route_decisions.jsonl`` (``RouteDecision`` JSONL: the prefix
match the router predicted vs the ``cached_tokens`` the engine reported) and the HTML
report ``DIR/report/index.html`` with its PNGs (start times per event class, the node
inventory, and the routing part: summary per strategy, per-instance share, KV hit rate
over time, predicted vs actual cached tokens), prints a summary, and with ``--json`` a
machine-readable one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from preheat.bench.models import generate_model, rewrite_shard, write_http_manifest
from preheat.config import format_size
from preheat.control.spec import EndpointSpec, parse_cluster, parse_endpoint
from preheat.control.state import VariantStatus
from preheat.runtime.local import LocalFleet
from preheat.runtime.procs import free_port
from preheat.telemetry.events import StartRecord, read_start_records

from .demo_traffic import documents, traffic, workload

__all__ = ["PROFILE", "SHARDS", "run_demo"]

SHARDS = 8
PROFILE = "qwen3-32b-1xh200"


# --- pieces --------------------------------------------------------------------------------


async def _origin(root: Path) -> tuple[web.AppRunner, str]:
    """A static HTTP origin on 127.0.0.1 (aiohttp serves Range requests)."""
    app = web.Application()
    app.router.add_static("/", root, show_index=False, follow_symlinks=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _make_models(origin: Path, size: int, seed: int) -> tuple[Path, Path, int]:
    """v1, and v2 = v1 with one shard rewritten (other files hard-linked); shard size."""
    v1 = origin / "sample-v1"
    v2 = origin / "sample-v2"
    generate_model(v1, size, SHARDS, seed=seed)
    write_http_manifest(v1)
    v2.mkdir(parents=True, exist_ok=True)
    for p in v1.iterdir():
        if p.is_file() and p.name != "preheat-manifest.json":
            os.link(p, v2 / p.name)
    changed = rewrite_shard(v2, SHARDS // 2, seed + 1)
    write_http_manifest(v2)
    return v1, v2, changed.stat().st_size


def _spec(name: str, source: str, *, cache: bool, strategy: str, replicas_max: int) -> EndpointSpec:
    doc: dict[str, Any] = {
        "name": name,
        "model": {"source": source},
        "engine": {"simulated": {"profile": PROFILE, "time_scale": 0.1, "kv_blocks": 1000}},
        "replicas": {"min": 1, "max": replicas_max},
        # The prefix covers a whole document (8,000 characters) plus the start of the
        # question, so the router's predicted cached tokens can match what engines report.
        "routing": {"strategy": strategy, "prefix_length": 9000, "concurrency_threshold": 8},
    }
    if cache:
        doc["modelCacheConfig"] = {
            "weights": {
                "enabled": True,
                "nodes": {"selector": {"pool": "gpu"}},
                "minReady": 3,
                "pin": True,
                "timeoutSeconds": 300,
            }
        }
    return parse_endpoint(doc)


def _stages(rec: StartRecord) -> dict[str, Any]:
    return {
        "replica": rec.replica,
        "node": rec.node,
        "event_class": rec.event_class.value,
        "weights_source": rec.weights_source,
        "bytes_from_origin": rec.bytes_from.get("origin", 0),
        "bytes_from_peer": rec.bytes_from.get("peer", 0),
        "ready": round(rec.ready_seconds or 0.0, 3),
        "first_response": round((rec.first_response or rec.scheduled) - rec.scheduled, 3),
        "stages": {k: round(v, 3) for k, v in rec.stage_durations().items()},
    }


# --- the story -----------------------------------------------------------------------------


async def run_demo(
    out: Path,
    *,
    size: int,
    bandwidth: int,
    requests: int,
    concurrency: int,
    keep: bool,
    say: Callable[[str], None],
    decision_sample: float = 1.0,
    wait_view: Callable[[LocalFleet, str, Callable[[LocalFleet], bool], float], Awaitable[None]],
) -> dict[str, Any]:
    """Run the whole demo; returns the summary (see ``preheat demo --help``)."""
    t_start = time.monotonic()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    (out / "events.jsonl").unlink(missing_ok=True)
    decisions = out / "route_decisions.jsonl"
    decisions.unlink(missing_ok=True)
    origin_root = work / "origin"

    say(
        f"[1/6] generating a {format_size(size)} sample model ({SHARDS} shards) and a revision that changes one shard"
    )
    _v1, _v2, shard_bytes = await asyncio.to_thread(_make_models, origin_root, size, 1)
    runner, base = await _origin(origin_root)
    src1 = f"{base}/sample-v1/preheat-manifest.json"
    src2 = f"{base}/sample-v2/preheat-manifest.json"
    cluster = parse_cluster(
        {
            "origin": {"bandwidth": bandwidth},
            "nodes": [
                {
                    "name": f"node-{i}",
                    "store": f"nodes/node-{i}",
                    "capacity": 3 * size,
                    "labels": {"pool": "gpu"},
                    "slots": 1,
                }
                for i in (1, 2, 3)
            ],
        },
        base_dir=work,
    )
    spec = _spec("demo", src1, cache=False, strategy="random", replicas_max=4)
    fleet = LocalFleet(spec, cluster, out, decision_log=decisions, decision_sample=decision_sample)
    summary: dict[str, Any] = {}
    inventory: list[Any] = []
    try:
        await fleet.start()
        model_bytes = 0

        say(
            "[2/6] no cache, and no node holds the model yet (no peer to fill from): one replica "
            f"downloads it from the origin itself, a real cold start ({format_size(bandwidth)}/s per node)"
        )
        await wait_view(fleet, "cold start", lambda f: f.ready_count() == 1, 600)
        model_bytes = fleet.status()["variants"][0]["model_bytes"]
        cold = [
            r
            for r in read_start_records(fleet.events.path)
            if r.weights_source == "origin" and r.ok
        ]

        say("[3/6] cache on: warming the target nodes, then scaling out onto warm nodes")
        await fleet.apply(_spec("demo", src1, cache=True, strategy="random", replicas_max=4))
        rev1 = fleet.status()["variants"][0]["revision"]
        await wait_view(
            fleet,
            "warm-up of the target nodes",
            lambda f: rev1 in f.statuses.get("main", VariantStatus()).gate_open,
            600,
        )
        n_before = len(read_start_records(fleet.events.path))
        await fleet.scale(3)
        await wait_view(fleet, "scale-out to 3", lambda f: f.ready_count() == 3, 600)
        warm = [
            r
            for r in read_start_records(fleet.events.path)[n_before:]
            if r.ok and r.weights_source == "cache"
        ]

        say(
            "[4/6] version change: warm the new revision (one shard moves), roll replicas, delete the old cache"
        )
        t_roll = time.monotonic()
        await fleet.apply(_spec("demo", src2, cache=True, strategy="random", replicas_max=4))
        rev2 = fleet.status()["variants"][0]["revision"]
        await wait_view(
            fleet,
            "rollout",
            lambda f: (
                f.status()["variants"][0]["stable"] == rev2
                and f.ready_count(revision=rev2) == 3
                and not any(rev1 in n["cache"] for n in f.status()["nodes"])
            ),
            600,
        )
        rollout_seconds = time.monotonic() - t_roll
        rollout_bytes = fleet.fetched_bytes(rev2)

        say("[5/6] a new node joins: it is warmed, and a scale-out lands on it")
        await fleet.add_node(
            "node-4",
            labels={"pool": "gpu"},
            capacity=3 * size,
            slots=1,
            store=work / "nodes" / "node-4",
        )
        await wait_view(
            fleet,
            "warm-up of node-4",
            lambda f: (
                f.nodes["node-4"].views.get(rev2) is not None
                and f.nodes["node-4"].views[rev2].state == "ready"
            ),
            600,
        )
        n_before = len(read_start_records(fleet.events.path))
        await fleet.scale(4)
        await wait_view(fleet, "scale-out to 4", lambda f: f.ready_count() == 4, 600)
        new_node = [r for r in read_start_records(fleet.events.path)[n_before:] if r.ok]

        say(f"[6/6] traffic: {requests} RAG-style requests, random vs prefix_aware routing")
        docs = documents(16, 8000, seed=3)
        prompts = workload(requests, docs, seed=4)
        routing: dict[str, Any] = {}
        for strategy in ("random", "prefix_aware"):
            await fleet.apply(_spec("demo", src2, cache=True, strategy=strategy, replicas_max=4))
            routing[strategy] = await traffic(fleet, prompts, concurrency)
            say(
                f"      {strategy:>13}: TTFT p50 {routing[strategy]['ttft_p50_ms']} ms, "
                f"p90 {routing[strategy]['ttft_p90_ms']} ms, KV hit rate {routing[strategy]['kv_hit_rate']}"
            )
        summary = {
            "model_bytes": model_bytes,
            "shards": SHARDS,
            "origin_bandwidth_bytes_per_s": bandwidth,
            "readiness_seconds": {
                "cold": _stages(cold[0]) if cold else None,
                "warm": _stages(min(warm, key=lambda r: r.ready_seconds or 0)) if warm else None,
                "new_node": _stages(new_node[0]) if new_node else None,
            },
            "rollout_bytes_fetched": rollout_bytes,
            "rollout_changed_shard_bytes": shard_bytes,
            "rollout_nodes": 3,
            "rollout_seconds": round(rollout_seconds, 2),
            "routing": routing,
            "restarts": fleet.restarts_total,
        }
        c, w = summary["readiness_seconds"]["cold"], summary["readiness_seconds"]["warm"]
        if c and w and w["ready"] > 0:
            summary["readiness_ratio_cold_over_warm"] = round(c["ready"] / w["ready"], 2)
        inventory = fleet.inventory()
    finally:
        await fleet.stop()
        await runner.cleanup()
    records = read_start_records(out / "events.jsonl")
    from preheat.telemetry.report import write_report

    routing_table = {
        s: {
            "TTFT p50 (ms)": v["ttft_p50_ms"],
            "TTFT p90 (ms)": v["ttft_p90_ms"],
            "KV hit rate": v["kv_hit_rate"],
            "max share": max(v["shares"].values()) if v["shares"] else None,
            "shares": {k: f"{100 * x:.0f}%" for k, x in v["shares"].items()},
        }
        for s, v in summary.get("routing", {}).items()
    }
    page = write_report(
        records,
        out / "report",
        routing_summary=routing_table,
        route_decisions_path=decisions if decisions.exists() else None,
        inventory=inventory,
        title="preheat demo: cold vs warm starts, rollout, routing",
    )
    summary["report"] = str(page)
    summary["events"] = str(out / "events.jsonl")
    summary["route_decisions"] = str(decisions)
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
