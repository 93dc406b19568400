"""Capacity planning with the cold-start simulator: 100 nodes, 20 models of 15-600 GB.

Two questions, on the fleet of ``benchmarks/sim_coldstart_models.yaml`` (Zipf(1.0)
popularity, 2.5 TB of models, three serving images of 1-12 GB), diurnal demand peaking
at 80 % of the fleet, 40 Gbps of origin bandwidth shared by all downloads, 10 Gbps of
registry bandwidth shared by all image pulls, 25 Gbps per node, one replica per node,
replica crashes (a mean of 7 days per replica, restarted in place) and a request queue
of 256 per model:

1. Readiness p99 of scale-out starts with no cache vs each cache policy (at one NVMe
   size, ``--nvme``), peers off and on.
2. The smallest per-node NVMe size (of ``--sizes``) at which the cache-miss share of all
   starts stays under 5 %, for the ``--sweep`` policies (``warm-all`` and ``lru``), peers
   off and on. ``--only 1`` or ``--only 2`` runs one question.

Rows print as runs finish (question 1 first), so a cut-short run still reports.

Every run is ``preheat sim coldstart`` with the same seed, so the runs see the same
demand; the command line of each is printed with its numbers.

    .venv/bin/python benchmarks/sim_coldstart_study.py --jobs 2 --duration 36h

Version changes: ``--releases-top 5`` gives the five most popular models one new
revision each (same size, at 8, 12, 16, 20 and 24 h; ``--release`` adds any other), so
the same questions are answered for a fleet that ships new revisions in the window.
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
    "registry_bandwidth": "10Gbps",
    "seed": 1,
}


def command(run: dict[str, Any]) -> str:
    releases = "".join(f" --release {r}" for r in run.get("releases", ()))
    return (
        f"preheat sim coldstart --nodes {run['nodes']} --nvme {run['nvme']} "
        f"--models benchmarks/{MODELS.name} --pattern {run['pattern']} "
        f"--cache-policy {run['policy']} --origin-bandwidth {run['origin_bandwidth']} "
        f"--registry-bandwidth {run['registry_bandwidth']} "
        f"--peers {'on' if run['peers'] else 'off'} --seed {run['seed']} "
        f"--duration {run['duration']}{releases}"
    )


def one(run: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    c0 = time.process_time()
    setup, rng = prepare(models=MODELS, **run)
    out = simulate(setup, rng).to_dict()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["cpu_s"] = round(time.process_time() - c0, 1)
    out["command"] = command(run)
    return out


def p99(out: dict[str, Any], cls: str = "scale_out") -> float | None:
    row = out["readiness"].get(cls)
    return None if row is None else row["p99_s"]


def plan_runs(
    nvme: str,
    sizes: list[str],
    duration: str,
    sweep: tuple[str, ...] = ("warm-all", "lru"),
    only: int | None = None,
    releases: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Question 1 first (every policy at ``nvme``, peers off, then on), then the sweep."""
    runs: list[dict[str, Any]] = []

    def add(policy: str, peers: bool, size: str) -> None:
        run = {**BASE, "policy": policy, "peers": peers, "nvme": size, "duration": duration}
        if releases:
            run["releases"] = releases
        if run not in runs:
            runs.append(run)

    if only in (None, 1):
        for peers in (False, True):
            for policy in CACHE_POLICIES:
                if not (policy == "none" and peers):  # no store: nothing to serve peers from
                    add(policy, peers, nvme)
    if only in (None, 2):
        for policy in sweep:
            for peers in (False, True):
                for size in sizes:
                    add(policy, peers, size)
    return runs


def top_releases(n: int) -> tuple[str, ...]:
    """The version-change scenario: model-00 at 8 h, model-01 at 12 h, ... (n models)."""
    return tuple(f"model-{i:02d}@{8 + 4 * i}h" for i in range(n))


HEADER = (
    "| policy | peers | NVMe | scale_out n | p50 s | p95 s | p99 s | miss share (all "
    "starts) | new_version n / miss share / p99 s | image pulls (of starts) | warm_restart n / p50 s | origin TB | peer TB | "
    "registry TB | unmet demand h | queue wait p50 / p99 s | dropped | CPU s |"
)


def row(r: dict[str, Any]) -> str:
    nan = float("nan")
    so = r["readiness"].get("scale_out", {})
    wr = r["readiness"].get("warm_restart", {})
    nv = r["readiness"].get("new_version", {})
    nv_miss = r["classes"].get("new_version", {}).get("miss_share", nan)
    q = r["queue"]
    return (
        f"| {r['policy']} | {'on' if r['peers'] else 'off'} | {r['nvme_bytes'] / 1e12:g} TB | "
        f"{so.get('n', 0)} | {so.get('p50_s', nan):.0f} | {so.get('p95_s', nan):.0f} | "
        f"{so.get('p99_s', nan):.0f} | {r['cache_miss_share']:.1%} | "
        f"{nv.get('n', 0)} / {nv_miss:.1%} / {nv.get('p99_s', nan):.0f} | "
        f"{r['image_pull_starts']} ({r['starts']}) | {wr.get('n', 0)} / "
        f"{wr.get('p50_s', nan):.0f} | {r['origin_bytes'] / 1e12:.1f} | "
        f"{r['peer_bytes'] / 1e12:.1f} | {r['registry_bytes'] / 1e12:.2f} | "
        f"{r['unmet_demand_s'] / 3600:.1f} | {q['wait_p50_s']:.0f} / {q['wait_p99_s']:.0f} | "
        f"{q['dropped_share']:.2%} | {r['cpu_s']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme", default="3TB", help="NVMe per node for question 1")
    ap.add_argument("--sizes", default="1TB,2TB,3TB,4TB", help="NVMe sizes for question 2")
    ap.add_argument("--duration", default="36h")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--sweep", default="warm-all,lru", help="policies for question 2")
    ap.add_argument("--only", type=int, choices=(1, 2), default=None, help="one question")
    ap.add_argument(
        "--release",
        action="append",
        default=[],
        metavar="MODEL@TIME[=SIZE]",
        help="a new revision during every run (repeatable; see preheat sim coldstart "
        "--release); --releases-top N is the study's version-change scenario",
    )
    ap.add_argument(
        "--releases-top",
        type=int,
        default=0,
        metavar="N",
        help="the N most popular models each get one new revision of the same size, "
        "one every 4 h from 8 h (model-00@8h, model-01@12h, ...)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write every result here")
    args = ap.parse_args()
    sweep = tuple(args.sweep.split(","))
    releases = (*args.release, *top_releases(args.releases_top))
    runs = plan_runs(args.nvme, args.sizes.split(","), args.duration, sweep, args.only, releases)
    print(f"# {len(runs)} runs, {args.jobs} processes; scale_out readiness, seconds")
    print(f"# loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    print(HEADER)
    print("|---" * HEADER.count(" | ") + "|---|")
    results = []
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for r in pool.map(one, runs):
            results.append(r)
            print(row(r), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    print(f"# {time.perf_counter() - t0:.0f} s wall, {sum(r['cpu_s'] for r in results):.0f} s CPU")
    print(f"# loadavg at end: {Path('/proc/loadavg').read_text().strip()}")
    print("\n## smallest NVMe with a cache-miss share under 5 %")
    for policy in sweep if args.only != 1 else ():
        for peers in (False, True):
            ok = sorted(
                r["nvme_bytes"]
                for r in results
                if r["policy"] == policy and r["peers"] == peers and r["cache_miss_share"] < 0.05
            )
            best = f"{ok[0] / 1e12:g} TB" if ok else "none of the sizes tried"
            print(f"- {policy}, peers {'on' if peers else 'off'}: {best}")
    print("\n## commands")
    for r in results:
        print(f"    {r['command']}")


if __name__ == "__main__":
    main()
