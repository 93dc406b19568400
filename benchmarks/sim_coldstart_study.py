"""Capacity planning with the cold-start simulator: 100 nodes, 20 models of 15-600 GB.

Two questions, on the fleet of ``benchmarks/sim_coldstart_models.yaml`` (Zipf(1.0)
popularity, 2.5 TB of models), diurnal demand peaking at 80 % of the fleet, 40 Gbps of
origin bandwidth shared by all downloads, 25 Gbps per node, one replica per node:

1. Readiness p99 of scale-out starts with no cache vs each cache policy (at one NVMe
   size, ``--nvme``), peers off and on.
2. The smallest per-node NVMe size (of ``--sizes``) at which the cache-miss share of all
   starts stays under 5 %, per policy, peers off and on.

Every run is ``preheat sim coldstart`` with the same seed, so the runs see the same
demand; the command line of each is printed with its numbers.

    .venv/bin/python benchmarks/sim_coldstart_study.py --jobs 2
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from preheat.sim.coldstart import simulate
from preheat.sim.coldstart_config import CACHE_POLICIES
from preheat.sim.coldstart_files import prepare

MODELS = Path(__file__).with_name("sim_coldstart_models.yaml")
BASE = {
    "nodes": 100,
    "pattern": "diurnal",
    "origin_bandwidth": "40Gbps",
    "node_bandwidth": "25Gbps",
    "seed": 1,
}


def command(run: dict[str, Any]) -> str:
    return (
        f"preheat sim coldstart --nodes {run['nodes']} --nvme {run['nvme']} "
        f"--models benchmarks/{MODELS.name} --pattern {run['pattern']} "
        f"--cache-policy {run['policy']} --origin-bandwidth {run['origin_bandwidth']} "
        f"--peers {'on' if run['peers'] else 'off'} --seed {run['seed']} "
        f"--duration {run['duration']}"
    )


def one(run: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    setup, rng = prepare(models=MODELS, **run)
    out = simulate(setup, rng).to_dict()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["command"] = command(run)
    return out


def p99(out: dict[str, Any], cls: str = "scale_out") -> float | None:
    row = out["readiness"].get(cls)
    return None if row is None else row["p99_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme", default="3TB", help="NVMe per node for question 1")
    ap.add_argument("--sizes", default="0.5TB,1TB,2TB,3TB,4TB", help="NVMe sizes for question 2")
    ap.add_argument("--duration", default="48h")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--policies", default=",".join(CACHE_POLICIES))
    ap.add_argument("--json", type=Path, default=None, help="also write every result here")
    args = ap.parse_args()
    policies = args.policies.split(",")
    runs: list[dict[str, Any]] = []
    for peers in (False, True):
        for policy in policies:
            if policy == "none" and peers:
                continue  # no store, nothing to serve peers from
            for nvme in dict.fromkeys([args.nvme, *args.sizes.split(",")]):
                if policy == "none" and nvme != args.nvme:
                    continue  # no store: the size does not matter
                runs.append(
                    {**BASE, "policy": policy, "peers": peers, "nvme": nvme,
                     "duration": args.duration}
                )  # fmt: skip
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, runs))
    print(f"# {len(runs)} runs in {time.perf_counter() - t0:.0f} s wall ({args.jobs} processes)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))

    print(f"\n## 1. scale-out readiness at {args.nvme} NVMe per node")
    print("| policy | peers | scale_out n | p50 s | p95 s | p99 s | miss share | origin TB | "
          "peer TB | unmet demand h |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["nvme_bytes"] != prepare(models=MODELS, **{**runs[0], "nvme": args.nvme})[0].nvme:
            continue
        so = r["readiness"].get("scale_out", {})
        print(
            f"| {r['policy']} | {'on' if r['peers'] else 'off'} | {so.get('n', 0)} | "
            f"{so.get('p50_s', float('nan')):.0f} | {so.get('p95_s', float('nan')):.0f} | "
            f"{so.get('p99_s', float('nan')):.0f} | {r['cache_miss_share']:.1%} | "
            f"{r['origin_bytes'] / 1e12:.1f} | {r['peer_bytes'] / 1e12:.1f} | "
            f"{r['unmet_demand_s'] / 3600:.1f} |"
        )

    print("\n## 2. cache-miss share of all starts by NVMe size")
    sizes = list(dict.fromkeys(args.sizes.split(",")))
    print("| policy | peers | " + " | ".join(sizes) + " | smallest under 5% |")
    print("|---|---|" + "---|" * (len(sizes) + 1))
    for peers in (False, True):
        for policy in policies:
            if policy == "none":
                continue
            row = []
            best = "none of these"
            for size in sizes:
                nv = prepare(models=MODELS, **{**runs[0], "nvme": size})[0].nvme
                match = [
                    r for r in results
                    if r["policy"] == policy and r["peers"] == peers and r["nvme_bytes"] == nv
                ]  # fmt: skip
                share = match[0]["cache_miss_share"]
                row.append(f"{share:.1%}")
                if share < 0.05 and best == "none of these":
                    best = size
            print(f"| {policy} | {'on' if peers else 'off'} | " + " | ".join(row) + f" | {best} |")

    print("\n## commands")
    for r in results:
        print(f"    {r['command']}   # {r['wall_s']} s")


if __name__ == "__main__":
    main()
