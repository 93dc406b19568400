"""Hit rate and balance of the ``stable`` placement under KV pressure, in the simulator.

The four cells of docs/benchmarks.md's Router 7 comparison (4 and 7 engines, RAG + chat
and code completion, 600 KV blocks per engine), each one ``preheat sim routing`` run
(virtual time, so the host's load does not change the figures). ``--pythonpath`` runs
another checkout's code (e.g. ``git archive`` of an older commit) for a before/after in
one go.

    .venv/bin/python benchmarks/stable_load.py
    .venv/bin/python benchmarks/stable_load.py --pythonpath /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

CELLS = [(4, "rag_chat"), (4, "code_completion"), (7, "rag_chat"), (7, "code_completion")]


def _run(n: int, workload: str, args: argparse.Namespace) -> dict[str, object]:
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    cmd = [
        sys.executable, "-c", "from preheat.cli import main; main()", "sim", "routing", "--instances", str(n),
        "--profile", "llama-3.1-70b-8xh100", "--kv-blocks", str(args.kv_blocks),
        "--policy", "prefix_aware", "--placement", "stable", "--workload", workload,
        "--requests", str(args.requests), "--concurrency", str(args.concurrency),
        "--seed", str(args.seed), "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    s: dict[str, object] = json.loads(out.stdout)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=14)
    ap.add_argument("--kv-blocks", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pythonpath", help="PYTHONPATH for the runs (another checkout's src)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    args = ap.parse_args()
    with ThreadPoolExecutor(args.jobs) as ex:
        runs = list(ex.map(lambda c: _run(c[0], c[1], args), CELLS))
    print("| cell | hit rate | max share / mean | TTFT p90 ms |")
    print("|---|---|---|---|")
    for (n, w), s in zip(CELLS, runs, strict=True):
        print(
            f"| {n}, {w} | {s['kv_hit_rate']:.3f} | {s['max_share_over_mean']:.2f} "
            f"| {s['ttft_p90_ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
