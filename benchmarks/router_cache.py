"""Cache effect of routing on 7 simulated engines (70B profile, time-scaled).

For each workload (RAG over Zipf-popular documents, multi-turn chat, templated assistant,
unique prompts) and each router it empties the engines' prefix caches, drives the same
seeded request stream through the router at a fixed concurrency, and reports the KV hit
rate from the engines' own /metrics, TTFT p50/p90, throughput, the largest
per-instance share over the mean, and the oracle bound. Like with like: preheat
``random`` against sglang-router's and vllm-router's ``random``, preheat ``prefix_aware``
(any placement) against their ``cache_aware``; ``least_outstanding`` has no peer
counterpart and is shown without a ratio. Peers run with their default retries.

    .venv/bin/python benchmarks/router_cache.py --n 300 --concurrency 14 --json out.json

``--pythonpath DIR`` runs the engines and preheat's routers from another checkout's
``src`` (e.g. the untouched base, for a before/after of a policy change in one shell).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from preheat.bench.compare import counterparts
from preheat.bench.routing import drive, engine_counters, oracle_hit_rate, reset_caches, summarize
from preheat.bench.workloads import WORKLOADS
from preheat.testing.engines import simulated_engines
from preheat.testing.routers import RouterProcess, launch_router, start_peer_router

OURS = ("random", "least_outstanding", "prefix_aware")
PEERS = ("sglang", "vllm")
DEFAULT_ROUTERS = (
    "random,sglang-random,vllm-random,"
    "prefix_aware,prefix_aware-hybrid,sglang-cache_aware,vllm-cache_aware,least_outstanding"
)


@contextlib.contextmanager
def router_for(
    name: str, urls: list[str], args: argparse.Namespace, logdir: Path
) -> Iterator[RouterProcess]:
    if name.split("-")[0] in OURS:
        strategy, _, placement = name.partition("-")
        extra = ["--balance-epsilon", str(args.epsilon)]
        extra += ["--placement", placement] if placement else []
        r = launch_router(
            backends=urls,
            strategy=strategy,
            prefix_length=args.prefix_length,
            concurrency_threshold=args.threshold,
            extra_args=extra,
            log_path=logdir / f"router-{name}.log",
        )
        try:
            yield r
        finally:
            r.stop()
    else:
        kind, _, policy = name.partition("-")
        if kind not in PEERS or not policy:
            raise SystemExit(
                f"router {name!r}: use a preheat strategy or PEER-POLICY, e.g. sglang-random"
            )
        with start_peer_router(kind, urls, policy=policy, log_path=logdir / f"{name}.log") as r:
            yield r


async def one_run(
    name: str, urls: list[str], items: list[Any], args: argparse.Namespace, logdir: Path
) -> dict[str, Any]:
    await reset_caches(urls)
    with router_for(name, urls, args, logdir) as r:
        before = await engine_counters(urls)
        outcomes, wall = await drive(r.url, items, concurrency=args.concurrency)
        await asyncio.sleep(0.2)
        after = await engine_counters(urls)
        outcomes_by_kind = {}
        if name.split("-")[0] in OURS:
            import urllib.request

            with urllib.request.urlopen(r.url + "/metrics") as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith("preheat_router_decisions_total{"):
                        kind = line.split('outcome="')[1].split('"')[0]
                        outcomes_by_kind[kind] = int(float(line.rsplit(" ", 1)[1]))
    errors = [o.error for o in outcomes if o.status != 200]
    if errors:
        print(f"{name}: {len(errors)} errors, first: {errors[0]}")
    out = summarize(outcomes, wall, before, after)
    out["outcomes"] = outcomes_by_kind
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="rag,chat,templated,unique")
    ap.add_argument(
        "--routers",
        default=DEFAULT_ROUTERS,
        help="preheat strategies (prefix_aware-hash, prefix_aware-hybrid: that placement) "
        "and peers as PEER-POLICY: sglang-random, vllm-cache_aware... (leave them out to "
        "save time)",
    )
    ap.add_argument("--n", type=int, default=300, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=14)
    ap.add_argument("--instances", type=int, default=7)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument(
        "--kv-blocks", type=int, default=2000, help="KV capacity per engine (16-token blocks)"
    )
    ap.add_argument("--prefix-length", type=int, default=8192)
    ap.add_argument("--threshold", type=int, default=64)
    ap.add_argument("--epsilon", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write all results here")
    ap.add_argument(
        "--pythonpath", help="PYTHONPATH of the engines and preheat routers (another src)"
    )
    args = ap.parse_args()
    if args.pythonpath:
        # The engine and router processes inherit it (preheat.testing.procs).
        os.environ["PYTHONPATH"] = args.pythonpath
    console = Console()
    console.print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    results: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}, "runs": {}}
    logdir = Path(tempfile.mkdtemp(prefix="router-cache-"))
    with simulated_engines(
        args.instances,
        profile="llama-3.1-70b-8xh100",
        time_scale=args.time_scale,
        kv_blocks=args.kv_blocks,
        model_name="m",
        log_dir=logdir,
    ) as engines:
        urls = [e.url for e in engines]
        for wl in args.workloads.split(","):
            items = WORKLOADS[wl](args.n, seed=args.seed)
            oracle = oracle_hit_rate(items)
            table = Table(
                title=f"{wl}: {args.n} requests, concurrency {args.concurrency}, oracle hit rate {oracle:.3f}"
            )
            for col in (
                "router",
                "hit rate",
                "/oracle",
                "TTFT p50 ms",
                "TTFT p90 ms",
                "req/s",
                "max share/mean",
                "errors",
            ):
                table.add_column(col, justify="right")
            results["runs"][wl] = {"oracle_hit_rate": oracle}
            for name in args.routers.split(","):
                t0 = time.time()
                s = asyncio.run(one_run(name, urls, items, args, logdir))
                s["run_s"] = time.time() - t0
                results["runs"][wl][name] = s
                table.add_row(
                    name,
                    f"{s['hit_rate']:.3f}",
                    f"{s['hit_rate'] / oracle:.2f}" if oracle else "-",
                    f"{(s['ttft_p50_s'] or 0) * 1000:.0f}",
                    f"{(s['ttft_p90_s'] or 0) * 1000:.0f}",
                    f"{s['throughput_rps']:.1f}",
                    f"{s['max_share_ratio']:.2f}",
                    str(s["errors"]),
                )
                console.print(f"  {wl}/{name}: done in {s['run_s']:.0f} s {s['outcomes']}")
            console.print(table)
            runs = {k: v for k, v in results["runs"][wl].items() if k != "oracle_hit_rate"}
            ours = [n for n in runs if n.split("-")[0] in OURS]
            for a, b in counterparts(runs, ours):
                ra, rb = runs[a], runs[b]
                hit = f" ({ra['hit_rate'] / rb['hit_rate']:.2f}x)" if rb["hit_rate"] else ""
                console.print(
                    f"  {wl}: {a} vs {b}: hit rate {ra['hit_rate']:.3f} vs {rb['hit_rate']:.3f}{hit}, "
                    f"TTFT p50 {(ra['ttft_p50_s'] or 0) * 1e3:.0f} vs {(rb['ttft_p50_s'] or 0) * 1e3:.0f} ms, "
                    f"p90 {(ra['ttft_p90_s'] or 0) * 1e3:.0f} vs {(rb['ttft_p90_s'] or 0) * 1e3:.0f} ms, "
                    f"max share {ra['max_share_ratio']:.2f} vs {rb['max_share_ratio']:.2f}"
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    console.print(f"logs in {logdir}")


if __name__ == "__main__":
    main()
