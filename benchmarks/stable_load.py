"""Hit rate and balance of the ``stable`` placement under KV pressure, in the simulator.

The four cells of docs/benchmarks.md's Router 7 comparison (4 and 7 engines, RAG + chat
and code completion, 600 KV blocks per engine), each one ``preheat sim routing`` run
(virtual time, so the host's load does not change the figures). ``--pythonpath`` runs
another checkout's code (e.g. ``git archive`` of an older commit) for a before/after in
one go. ``--requests`` and ``--seeds`` take lists: every cell runs at each length and
seed, and the summary gives each cell's worst share and mean hit rate over them (the
balance bound must hold at every length and seed, not on average).

    .venv/bin/python benchmarks/stable_load.py
    .venv/bin/python benchmarks/stable_load.py --requests 600,1800 --seeds 1,2
    .venv/bin/python benchmarks/stable_load.py --pythonpath /tmp/old/src
    .venv/bin/python benchmarks/stable_load.py --requests 600,1800 --seeds 1,2 --placement stable-split
    .venv/bin/python benchmarks/stable_load.py --requests 600,1800 --seeds 1,2 --placement stable-move
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CELLS = [(4, "rag_chat"), (4, "code_completion"), (7, "rag_chat"), (7, "code_completion")]


def _run(
    n: int, workload: str, requests: int, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    cmd = [
        sys.executable, "-c", "from preheat.cli import main; main()", "sim", "routing", "--instances", str(n),
        "--profile", "llama-3.1-70b-8xh100", "--kv-blocks", str(args.kv_blocks),
        "--policy", "prefix_aware", "--placement", args.placement, "--workload", workload,
        "--requests", str(requests), "--concurrency", str(args.concurrency),
        "--seed", str(seed), "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    s: dict[str, Any] = json.loads(out.stdout)
    return s


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{text!r}: give comma-separated integers, e.g. 600,1800") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="600", help="requests per run (a list: 600,1800)")
    ap.add_argument("--concurrency", type=int, default=14)
    ap.add_argument("--kv-blocks", type=int, default=600)
    ap.add_argument("--seeds", default="1", help="workload and policy seeds (a list: 1,2)")
    ap.add_argument("--pythonpath", help="PYTHONPATH for the runs (another checkout's src)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument(
        "--placement",
        default="stable",
        help="prefix_aware placement (stable, stable-split, stable-move...)",
    )
    args = ap.parse_args()
    grid = [(c, r, s) for c in CELLS for r in _ints(args.requests) for s in _ints(args.seeds)]
    with ThreadPoolExecutor(args.jobs) as ex:
        runs = list(ex.map(lambda g: _run(g[0][0], g[0][1], g[1], g[2], args), grid))
    print("| cell | requests | seed | hit rate | max share / mean | TTFT p90 ms |")
    print("|---|---|---|---|---|---|")
    for ((n, w), r, seed), s in zip(grid, runs, strict=True):
        print(
            f"| {n}, {w} | {r} | {seed} | {s['kv_hit_rate']:.3f} "
            f"| {s['max_share_over_mean']:.3f} | {s['ttft_p90_ms']:.0f} |"
        )
    print()
    print("| cell | mean hit rate | worst max share / mean |")
    print("|---|---|---|")
    for n, w in CELLS:
        sel = [s for ((m, v), _, _), s in zip(grid, runs, strict=True) if (m, v) == (n, w)]
        hit = sum(float(s["kv_hit_rate"]) for s in sel) / len(sel)
        worst = max(float(s["max_share_over_mean"]) for s in sel)
        print(f"| {n}, {w} | {hit:.4f} | {worst:.3f} |")


if __name__ == "__main__":
    main()
