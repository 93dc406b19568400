"""Cross-check: one trace through a live local fleet and through the simulator, side by side.

Writes a seeded workload as a JSONL trace (OpenAI bodies, no times: closed loop), then

* **live**: 4 simulated engines (``tiny`` profile, ``--time-scale``: each step sleeps its
  duration x scale) behind a real ``preheat router serve`` process, driven at
  ``--concurrency`` by ``bench.routing.drive``; hit rate from the engines' /metrics,
  TTFT p50 from the client, divided by the time scale;
* **sim**: ``preheat.sim`` on the same trace, instances named by the live URLs and the
  router's salt, so the policy ranks instances the same way.

It prints both and the relative difference, and fails (exit 1) beyond ``--tolerance``.

    .venv/bin/python benchmarks/sim_crosscheck.py --n 300 --concurrency 8 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from preheat.bench.routing import drive, engine_counters, reset_caches, summarize
from preheat.bench.workloads import WORKLOADS, WorkItem
from preheat.router.policies import PolicyParams
from preheat.sim.routing import RoutingConfig, simulate_routing
from preheat.sim.trace import parse_trace
from preheat.testing.engines import simulated_engines
from preheat.testing.routers import DEFAULT_SALT, launch_router
from preheat.timing import get_profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="rag")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--strategy", default="prefix_aware")
    ap.add_argument("--time-scale", type=float, default=40.0)
    ap.add_argument("--kv-blocks", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    kw: dict[str, object] = {"max_tokens": args.max_tokens}
    if args.workload == "rag":
        kw |= {"documents": 16, "doc_chars": 3000}
    work = WORKLOADS[args.workload](args.n, seed=args.seed, **kw)
    tmp = Path(tempfile.mkdtemp(prefix="sim-crosscheck-"))
    trace = tmp / "trace.jsonl"
    trace.write_text("".join(json.dumps(w.body) + "\n" for w in work))
    items = parse_trace(trace.read_text().splitlines(), where=str(trace))
    live_items = [WorkItem(i.request_id, i.path or "", dict(i.body), "trace") for i in items]

    with simulated_engines(
        args.instances,
        profile="tiny",
        time_scale=args.time_scale,
        kv_blocks=args.kv_blocks,
        model_name="m",
        log_dir=tmp,
    ) as engines:
        urls = [e.url for e in engines]
        asyncio.run(reset_caches(urls))
        router = launch_router(
            backends=urls,
            strategy=args.strategy,
            log_path=tmp / "router.log",
            salt=DEFAULT_SALT,
        )
        try:
            before = asyncio.run(engine_counters(urls))
            t0 = time.perf_counter()
            outcomes, wall = asyncio.run(
                drive(router.url, live_items, concurrency=args.concurrency)
            )
            live_run_s = time.perf_counter() - t0
            time.sleep(0.2)
            after = asyncio.run(engine_counters(urls))
        finally:
            router.stop()
    live = summarize(outcomes, wall, before, after)
    # The router hashes its salt material into the key it uses (cli/router.py _salt).
    salt = hashlib.sha256(DEFAULT_SALT.encode()).digest()
    cfg = RoutingConfig(
        instances=args.instances,
        profile=get_profile("tiny"),
        policy=args.strategy,
        params=PolicyParams(),
        kv_blocks=args.kv_blocks,
        concurrency=args.concurrency,
        salt=salt,
        ids=tuple(urls),
    )
    t0 = time.perf_counter()
    sim = simulate_routing(items, cfg, policy_rng=random.Random(args.seed)).summary()
    sim_run_s = time.perf_counter() - t0
    rows = {
        "kv_hit_rate": (live["hit_rate"], sim["kv_hit_rate"]),
        "ttft_p50_ms": ((live["ttft_p50_s"] or 0) * 1000 / args.time_scale, sim["ttft_p50_ms"]),
        "ttft_p90_ms": ((live["ttft_p90_s"] or 0) * 1000 / args.time_scale, sim["ttft_p90_ms"]),
        "max_share_over_mean": (live["max_share_ratio"], sim["max_share_over_mean"]),
    }
    print(f"{args.n} requests of {args.workload}, {args.instances} x tiny, {args.strategy}, "
          f"concurrency {args.concurrency}, time scale {args.time_scale}; "
          f"live {live_run_s:.0f} s, sim {sim_run_s:.2f} s; errors live {live['errors']}")  # fmt: skip
    print(f"{'metric':22} {'live':>10} {'sim':>10} {'sim/live-1':>11}")
    ok = live["errors"] == 0
    result: dict[str, object] = {"args": vars(args) | {"json": str(args.json)}, "rows": {}}
    for k, (a, b) in rows.items():
        rel = b / a - 1 if a else float("inf")
        print(f"{k:22} {a:10.4f} {b:10.4f} {rel:+11.1%}")
        result["rows"][k] = {"live": a, "sim": b, "rel": rel}  # type: ignore[index]
        if k in ("kv_hit_rate", "ttft_p50_ms") and abs(rel) > args.tolerance:
            ok = False
    print("within tolerance" if ok else f"OUTSIDE the {args.tolerance:.0%} tolerance")
    result |= {"ok": ok, "live_run_s": live_run_s, "sim_run_s": sim_run_s, "sim": sim}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
