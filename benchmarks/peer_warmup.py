"""Peer-to-peer warm-up: bytes moved from the origin, and time to warm N nodes.

Real processes end to end: an nginx origin on 127.0.0.1 with an access log (origin bytes
are counted *at the origin*: the sum of ``$body_bytes_sent``), local fleets whose nodes
serve their stores to each other (``runtime.peering``), simulated engines.

1. Origin bytes: ``--nodes`` nodes (6) warm a ``--size`` model (400 MB) with the origin
   budget at one concurrent fill; the ratio origin bytes / model size must be <= 1.10.
2. Scaling: for N in ``--scale`` (2, 4, 8), the time from fleet start until every node
   holds a ``--scale-size`` model, with peers and with ``peers.enabled: false``, same
   per-node bandwidth (``origin.bandwidth``, which limits a node's downloads from peers
   too) and the origin link limited to the same rate (``origin.budget.bandwidth``), so
   without peers the origin link is the bottleneck.
3. Filling seeds: ``--seed-nodes`` nodes (6) warm the ``--size`` model at ``--bandwidth``
   per node, origin budget at one concurrent fill, first with receivers that wait for a
   *complete* holder (``FleetPeers.seed_sources = False``, the old planner), then with
   receivers that take the seed while it still fills (the default); same run, same
   settings, alternating ``--repeat`` times. Origin bytes must stay <= 1.10x the model.

    .venv/bin/python benchmarks/peer_warmup.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from preheat.config import format_size, parse_size
from preheat.control.spec import parse_cluster
from preheat.runtime.local import LocalFleet
from preheat.testing.fleet import endpoint_spec, make_model
from preheat.testing.origins import nginx_origin, origin_bytes_sent


def _cluster(base: Path, n: int, size: int, **top: Any) -> Any:
    nodes = [{"name": f"n{i}", "capacity": 3 * size, "slots": 1} for i in range(n)]
    return parse_cluster({"nodes": nodes, **top}, base_dir=base)


async def warm(
    source: str, cluster: Any, state: Path, timeout: float, *, seed_sources: bool = True
) -> dict[str, Any]:
    """Start a fleet, wait until every node holds the revision; seconds and records."""
    spec = endpoint_spec("bench", source, replicas=1, cache={"enabled": True})
    t0 = time.monotonic()
    fleet = LocalFleet(spec, cluster, state)
    if fleet.warmer.peers is not None:
        fleet.warmer.peers.seed_sources = seed_sources
    async with fleet:

        def done(f: LocalFleet) -> bool:
            rev = f.status()["variants"][0]["revision"]
            return bool(rev) and all(
                n["cache"].get(rev, {}).get("state") == "ready" for n in f.status()["nodes"]
            )

        await fleet.wait_until(done, timeout, "every node warm")
        seconds = time.monotonic() - t0
        status = fleet.status()
        log = (state / "logs" / "fleet.log").read_text()
        retries = [
            line for line in log.splitlines() if "peer failure" in line or "avoiding" in line
        ]
        return {
            "seconds": round(seconds, 2),
            "warmups": status["warmups"],
            "revisions": status["revisions"],
            "peer_retries": retries,
        }


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    origin_dir = root / "origin"
    size = parse_size(args.size)
    big = (
        make_model(origin_dir / "big", size=size, shards=8, seed=1)
        if args.nodes or args.seed_nodes
        else None
    )
    small = make_model(origin_dir / "small", size=parse_size(args.scale_size), shards=4, seed=2)
    bw = parse_size(args.bandwidth.removesuffix("/s"))

    # 1. origin bytes for --nodes nodes, origin budget at one concurrent fill
    if args.nodes:
        out["origin_bytes"] = await origin_run(args, root, origin_dir, big)
    if args.scale:
        out["scaling"] = await scaling_run(args, root, origin_dir, small, bw)
    if args.seed_nodes and big is not None:
        out["filling_seed"] = await seed_run(args, root, origin_dir, big, bw)
    return out


async def seed_run(
    args: argparse.Namespace, root: Path, origin_dir: Path, big: Any, bw: int
) -> dict[str, Any]:
    """3. ``--seed-nodes`` nodes: receivers wait for a complete seed, or take it filling."""
    runs: dict[str, list[dict[str, Any]]] = {"complete_seed": [], "filling_seed": []}
    for i in range(args.repeat):
        for label, on in (("complete_seed", False), ("filling_seed", True)):
            log = root / f"access-seed-{label}-{i}.log"
            base = root / f"seed-{label}-{i}"
            with nginx_origin(origin_dir, access_log=log, workers=4) as origin:
                cluster = _cluster(
                    base,
                    args.seed_nodes,
                    big.size,
                    origin={"bandwidth": bw, "budget": {"concurrentFills": 1}},
                )
                res = await warm(
                    big.http_ref(origin.base_url, origin_dir),
                    cluster,
                    base / "state",
                    900,
                    seed_sources=on,
                )
            runs[label].append(
                {
                    "wall": res["seconds"],
                    "warm": max(w["seconds"] for w in res["warmups"]),
                    "origin_ratio": round(origin_bytes_sent(log) / big.size, 4),
                    "modes": sorted(w["mode"] for w in res["warmups"]),
                    "bytes_from": sorted((w["node"], w["bytes_from"]) for w in res["warmups"]),
                    "peer_retries": res["peer_retries"],
                }
            )
            shutil.rmtree(base, ignore_errors=True)
    best = {k: min(r["warm"] for r in v) for k, v in runs.items()}
    return {
        "nodes": args.seed_nodes,
        "model_bytes": big.size,
        "per_node_bytes_per_s": bw,
        "runs": runs,
        "speedup_warm": round(best["complete_seed"] / best["filling_seed"], 2),
    }


async def origin_run(args: argparse.Namespace, root: Path, origin_dir: Path, big: Any) -> Any:
    size = big.size
    log = root / "access-1.log"
    with nginx_origin(origin_dir, access_log=log, workers=4) as origin:
        cluster = _cluster(
            root / "one", args.nodes, size, origin={"budget": {"concurrentFills": 1}}
        )
        res = await warm(big.http_ref(origin.base_url, origin_dir), cluster, root / "s1", 600)
    sent = origin_bytes_sent(log)
    shutil.rmtree(root / "one", ignore_errors=True)
    return {
        "nodes": args.nodes,
        "model_bytes": big.size,
        "origin_bytes_sent": sent,
        "ratio": round(sent / big.size, 4),
        "seconds": res["seconds"],
        "modes": sorted(w["mode"] for w in res["warmups"]),
        "warmup_seconds": sorted(w["seconds"] for w in res["warmups"]),
    }


async def scaling_run(
    args: argparse.Namespace, root: Path, origin_dir: Path, small: Any, bw: int
) -> Any:
    """2. time to warm N nodes, peers vs none, same per-node and origin-link bandwidth."""
    rows = []
    for n in args.scale:
        row: dict[str, Any] = {"n": n}
        for label, peers in (("peers", True), ("no_peers", False)):
            log = root / f"access-{n}-{label}.log"
            base = root / f"n{n}-{label}"
            with nginx_origin(origin_dir, access_log=log, workers=4) as origin:
                cluster = _cluster(
                    base,
                    n,
                    small.size,
                    origin={"bandwidth": bw, "budget": {"bandwidth": bw}},
                    peers={"enabled": peers},
                )
                res = await warm(
                    small.http_ref(origin.base_url, origin_dir), cluster, base / "state", 600
                )
            row[label] = res["seconds"]
            # the warm-up phase alone: the slowest node's WarmupRecord (wait included)
            row[f"{label}_warm"] = max(w["seconds"] for w in res["warmups"])
            row[f"{label}_origin_ratio"] = round(origin_bytes_sent(log) / small.size, 3)
            shutil.rmtree(base, ignore_errors=True)
        row["speedup"] = round(row["no_peers"] / row["peers"], 2)
        row["warm_speedup"] = round(row["no_peers_warm"] / row["peers_warm"], 2)
        rows.append(row)
    first = rows[0]
    for row in rows:
        row["peers_growth"] = round(row["peers"] / first["peers"], 2)
        row["no_peers_growth"] = round(row["no_peers"] / first["no_peers"], 2)
        row["peers_warm_growth"] = round(row["peers_warm"] / first["peers_warm"], 2)
        row["no_peers_warm_growth"] = round(row["no_peers_warm"] / first["no_peers_warm"], 2)
    return {"model_bytes": small.size, "per_node_and_origin_link_bytes_per_s": bw, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="400MB", help="model size for the origin-bytes run")
    p.add_argument(
        "--nodes", type=int, default=6, help="nodes in the origin-bytes run (0: skip it)"
    )
    p.add_argument("--scale", type=int, nargs="*", default=[2, 4, 8], help="N to time (none: skip)")
    p.add_argument(
        "--seed-nodes", type=int, default=6, help="nodes in the filling-seed run (0: skip it)"
    )
    p.add_argument("--repeat", type=int, default=1, help="filling-seed runs per setting")
    p.add_argument("--scale-size", default="64MB", help="model size for the scaling runs")
    p.add_argument("--bandwidth", default="32MB/s", help="per-node and origin-link rate")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="preheat-peers-"))
    try:
        result = asyncio.run(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"load {' '.join(result['loadavg'])}")
    ob = result.get("origin_bytes")
    if ob:
        print(
            f"{ob['nodes']} nodes x {format_size(ob['model_bytes'])}: origin sent "
            f"{format_size(ob['origin_bytes_sent'])} = {ob['ratio']}x the model, {ob['seconds']} s"
        )
    for row in result.get("scaling", {}).get("rows", []):
        print(
            f"N={row['n']}: peers {row['peers']} s, no peers {row['no_peers']} s "
            f"({row['speedup']}x); growth vs N={result['scaling']['rows'][0]['n']}: "
            f"{row['peers_growth']}x vs {row['no_peers_growth']}x; warm-up phase "
            f"{row['peers_warm']} s vs {row['no_peers_warm']} s"
        )
    fs = result.get("filling_seed")
    if fs:
        for label, runs in fs["runs"].items():
            for r in runs:
                print(
                    f"{fs['nodes']} nodes, {label}: warm-up {r['warm']} s, wall {r['wall']} s, "
                    f"origin {r['origin_ratio']}x, modes {r['modes']}"
                )
        print(f"filling seed vs complete seed: {fs['speedup_warm']}x faster warm-up")


if __name__ == "__main__":
    main()
