"""`preheat demo`: the command (options, progress, the printed summary).

The story it runs, and the files it writes, are ``preheat.cli.demo_story``; the routing
comparison's traffic is ``preheat.cli.demo_traffic``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from preheat.config import format_size, parse_size
from preheat.errors import PreheatError
from preheat.runtime.local import LocalFleet

from .demo_story import SHARDS, run_demo


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
