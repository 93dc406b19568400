"""`preheat demo`: the whole story on one machine in a few minutes.

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
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import click
from aiohttp import web
from rich.console import Console
from rich.table import Table

from preheat.bench.models import generate_model, rewrite_shard, write_http_manifest
from preheat.config import format_size, parse_size
from preheat.control.spec import EndpointSpec, parse_cluster, parse_endpoint
from preheat.control.state import VariantStatus
from preheat.errors import PreheatError
from preheat.runtime.local import LocalFleet
from preheat.runtime.procs import free_port
from preheat.telemetry.events import StartRecord, read_start_records
from preheat.telemetry.stats import percentile

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


def _documents(n: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [
        "cache", "node", "replica", "weights", "shard", "router", "prefix", "token", "latency",
        "origin", "bandwidth", "snapshot", "revision", "lease", "eviction", "warm", "cold",
        "kernel", "tensor", "batch", "decode", "prefill", "block", "hash", "policy", "fleet",
    ]  # fmt: skip
    docs = []
    for i in range(n):
        body = " ".join(rng.choice(words) for _ in range(chars // 6))
        docs.append(f"Document {i}: {body}"[:chars])
    return docs


def _workload(n: int, docs: list[str], seed: int) -> list[str]:
    """RAG-style prompts: a document (Zipf-like popularity) plus a unique question."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 0.8 for i in range(len(docs))]
    out = []
    for i in range(n):
        d = rng.choices(range(len(docs)), weights)[0]
        out.append(f"{docs[d]}\n\nQuestion {i}: what does the document say about item {i}?")
    return out


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _engine_counters(
    session: aiohttp.ClientSession, urls: dict[str, str]
) -> dict[str, tuple[float, float, float]]:
    """replica -> (prefix cache queries, hits, finished requests) from its /metrics."""
    out = {}
    for rid, url in urls.items():
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        out[rid] = (
            _metric_sum(text, "vllm:prefix_cache_queries_total"),
            _metric_sum(text, "vllm:prefix_cache_hits_total"),
            _metric_sum(text, "vllm:e2e_request_latency_seconds_count"),
        )
    return out


async def _traffic(fleet: LocalFleet, prompts: list[str], concurrency: int) -> dict[str, Any]:
    """Send ``prompts`` through the router; TTFT from the client, hits and shares from
    the engines' own counters (deltas over this run)."""
    urls = {r["id"]: r["url"] for r in fleet.status()["replicas"] if r["phase"] == "ready"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for url in urls.values():
            async with session.post(f"{url}/reset_prefix_cache") as resp:
                await resp.read()
        before = await _engine_counters(session, urls)
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        ttft: list[float] = []
        failed = 0

        async def worker() -> None:
            nonlocal failed
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {
                    "model": fleet.spec.name,
                    "prompt": prompt,
                    "max_tokens": 16,
                    "stream": True,
                    # The usage chunk carries the engine's cached_tokens, which the router
                    # writes into its decision log next to its own prediction.
                    "stream_options": {"include_usage": True},
                }
                t0 = time.monotonic()
                first = None
                try:
                    async with session.post(
                        f"{fleet.router.url}/v1/completions", json=body
                    ) as resp:
                        async for chunk in resp.content.iter_any():
                            if first is None and chunk:
                                first = time.monotonic()
                        if resp.status != 200:
                            failed += 1
                            continue
                except (aiohttp.ClientError, TimeoutError):
                    failed += 1
                    continue
                if first is not None:
                    ttft.append(first - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        after = await _engine_counters(session, urls)
    queries = sum(after[r][0] - before[r][0] for r in urls)
    hits = sum(after[r][1] - before[r][1] for r in urls)
    done = {r: after[r][2] - before[r][2] for r in urls}
    total = sum(done.values()) or 1.0
    return {
        "requests": len(prompts),
        "failed": failed,
        "ttft_p50_ms": round(1000 * percentile(ttft, 50), 2) if ttft else None,
        "ttft_p90_ms": round(1000 * percentile(ttft, 90), 2) if ttft else None,
        "kv_hit_rate": round(hits / queries, 4) if queries else None,
        "shares": {r: round(n / total, 4) for r, n in sorted(done.items())},
    }


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
        docs = _documents(16, 8000, seed=3)
        prompts = _workload(requests, docs, seed=4)
        routing: dict[str, Any] = {}
        for strategy in ("random", "prefix_aware"):
            await fleet.apply(_spec("demo", src2, cache=True, strategy=strategy, replicas_max=4))
            routing[strategy] = await _traffic(fleet, prompts, concurrency)
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


# --- the command ---------------------------------------------------------------------------


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    rs = s["readiness_seconds"]
    t = Table(title="replica readiness (seconds, per stage)", title_justify="left")
    stages = ["weights_ready", "runtime_started", "weights_loaded", "healthy", "first_response"]
    short = ["weights", "runtime", "loaded", "healthy", "1st resp"]
    t.add_column("start")
    t.add_column("node")
    t.add_column("from origin", justify="right")
    t.add_column("from peers", justify="right")
    for st in short:
        t.add_column(st, justify="right")
    t.add_column("ready", justify="right", style="bold")
    cold = "cold (no cache, no peer)"
    for label, key in ((cold, "cold"), ("warm", "warm"), ("new node", "new_node")):
        r = rs.get(key)
        if not r:
            continue
        t.add_row(
            label,
            r["node"],
            format_size(r["bytes_from_origin"]),
            format_size(r.get("bytes_from_peer", 0)),
            *(f"{r['stages'].get(st, 0):.2f}" for st in stages),
            f"{r['ready']:.2f}",
        )
    console.print(t)
    if "readiness_ratio_cold_over_warm" in s:
        console.print(
            f"cold / warm readiness: [bold]{s['readiness_ratio_cold_over_warm']}x[/] "
            f"(model {format_size(s['model_bytes'])}, origin {format_size(s['origin_bandwidth_bytes_per_s'])}/s per node)"
        )
    console.print(
        f"version change: {format_size(s['rollout_bytes_fetched'])} fetched from the origin for {s['rollout_nodes']} nodes "
        f"(the changed shard, {format_size(s['rollout_changed_shard_bytes'])}, once; peers carried it to the "
        f"other nodes; a full copy per node would be {format_size(s['model_bytes'] * s['rollout_nodes'])}), "
        f"rolled in {s['rollout_seconds']:.1f} s"
    )
    rt = Table(title="routing (same requests, same replicas)", title_justify="left")
    for col in ("strategy", "TTFT p50 ms", "TTFT p90 ms", "KV hit rate", "shares", "failed"):
        rt.add_column(col)
    for name, r in s["routing"].items():
        rt.add_row(
            name,
            str(r["ttft_p50_ms"]),
            str(r["ttft_p90_ms"]),
            f"{r['kv_hit_rate']:.1%}" if r["kv_hit_rate"] is not None else "-",
            " ".join(f"{v:.0%}" for v in r["shares"].values()),
            str(r["failed"]),
        )
    console.print(rt)
    console.print(
        f"report: {s['report']}\nevents: {s['events']}\n"
        f"routing decisions: {s['route_decisions']}\ntook {s['seconds']:.0f} s"
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Also print a machine-readable summary.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("preheat-demo"),
    show_default=True,
    help="Where events.jsonl, route_decisions.jsonl, summary.json, logs/ and report/ go.",
)
@click.option("--size", default="2GiB", show_default=True, help="Sample model size.")
@click.option(
    "--bandwidth",
    default="100MiB",
    show_default=True,
    help="Origin download limit per node, per second (makes the cold path slow).",
)
@click.option(
    "--requests",
    type=click.IntRange(10),
    default=240,
    show_default=True,
    help="Requests per routing strategy.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="Requests in flight at once during the routing comparison.",
)
@click.option(
    "--decision-sample",
    type=click.FloatRange(0.0, 1.0),
    default=1.0,
    show_default=True,
    help="Share of routed requests the router writes to DIR/route_decisions.jsonl.",
)
@click.option("--keep", is_flag=True, help="Keep the origin and node stores under DIR/work.")
def demo(
    as_json: bool,
    out: Path,
    size: str,
    bandwidth: str,
    requests: int,
    concurrency: int,
    decision_sample: float,
    keep: bool,
) -> None:
    """The whole story in a few minutes: cold vs warm starts, a one-shard version change,
    a new node, and random vs prefix-aware routing.

    \b
    Needs nothing but this package: the origin, the nodes, the replicas (simulated
    engines) and the router all run on 127.0.0.1. About 90 seconds on 2 cores with
    the defaults and about 6x --size of free disk while it runs (the origin and four
    node stores; removed at the end). Use --size 256MiB for a quicker look.
    """
    console = Console(stderr=as_json, width=None if sys.stderr.isatty() else 110)
    try:
        size_b = parse_size(size, what="--size")
        bw_b = parse_size(bandwidth.removesuffix("/s"), what="--bandwidth")
    except PreheatError as exc:
        raise click.BadParameter(str(exc)) from None
    if size_b < SHARDS * (1 << 20):
        raise click.BadParameter(f"--size {size} is too small; use at least {SHARDS}MiB")
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < 6 * size_b:
        raise click.BadParameter(
            f"{out} has {format_size(free)} free; the demo needs about 6x --size "
            f"({format_size(6 * size_b)}) while it runs. Use a smaller --size or another --out."
        )

    async def wait_view(
        fleet: LocalFleet, what: str, pred: Callable[[LocalFleet], bool], timeout: float
    ) -> None:
        t0 = time.monotonic()
        with console.status(what) as status:
            while not pred(fleet):
                if time.monotonic() - t0 > timeout:
                    raise PreheatError(f"the demo timed out waiting for {what}; see {out / 'logs'}")
                status.update(f"{what}: {_progress_line(fleet)}")
                await asyncio.sleep(0.2)
        console.print(f"      {what}: done in {time.monotonic() - t0:.1f} s")

    try:
        summary = asyncio.run(
            _stoppable(
                run_demo(
                    out,
                    size=size_b,
                    bandwidth=bw_b,
                    requests=requests,
                    concurrency=concurrency,
                    keep=keep,
                    decision_sample=decision_sample,
                    say=lambda m: console.print(m),
                    wait_view=wait_view,
                )
            )
        )
    except (PreheatError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo("interrupted; every process the demo started was stopped", err=True)
        sys.exit(130)
    _print_summary(console, summary)
    if as_json:
        click.echo(json.dumps(summary, indent=1))


async def _stoppable(coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Run ``coro``; SIGTERM cancels it like Ctrl-C does, so its clean-up (stopping the
    replicas and the router) always runs."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _progress_line(fleet: LocalFleet) -> str:
    parts = []
    for n in fleet.nodes.values():
        for _rev, (done, total) in list(n.progress.items()):
            parts.append(f"{n.spec.name} {100 * done / max(total, 1):.0f}%")
    phases = [f"{r.id}: {r.detail}" for r in fleet.replicas.values() if r.phase == "starting"]
    return "; ".join(parts + phases)[:150] or "..."
