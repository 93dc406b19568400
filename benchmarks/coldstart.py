"""Cold vs warm replica readiness, and bytes moved by a one-shard version change.

Real processes end to end: an nginx origin (HTTP with Range; falls back to a file://
origin when nginx is missing), node stores on disk with a per-node origin bandwidth
limit, simulated engines that really read every weight byte before /health, the router.

1. Cold: with the cache off, ``--rounds`` replicas start one after another, each on a
   node that does not hold the model, so each downloads it from the origin itself.
2. Warm: the endpoint is scaled to 0 and back; every replica restarts on a node that now
   holds the revision (a cache hit).
3. Version change: the cache is switched on and a revision that changes 1 of ``--shards``
   shards is applied; bytes fetched per node are compared with the shard and the model.

    .venv/bin/python benchmarks/coldstart.py --size 1GiB --bandwidth 100MiB --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from preheat.bench.models import rewrite_shard, write_http_manifest
from preheat.config import format_size, parse_size
from preheat.runtime.local import LocalFleet
from preheat.telemetry.events import read_start_records
from preheat.telemetry.stats import percentile
from preheat.testing.fleet import cluster_spec, endpoint_spec, make_model
from preheat.testing.origins import NGINX, nginx_origin


async def run(args: argparse.Namespace, root: Path, base: str | None) -> dict[str, object]:
    size = parse_size(args.size)
    bw = parse_size(args.bandwidth.removesuffix("/s"))
    m1 = make_model(root / "origin" / "v1", size=size, shards=args.shards, seed=1)
    v2 = root / "origin" / "v2"
    v2.mkdir()
    for p in m1.dir.iterdir():
        if p.name != "preheat-manifest.json":
            os.link(p, v2 / p.name)
    changed = rewrite_shard(v2, 0, 2)
    write_http_manifest(v2)
    if base:
        src1 = f"{base}/v1/preheat-manifest.json"
        src2 = f"{base}/v2/preheat-manifest.json"
    else:
        src1, src2 = m1.ref, f"file://{v2}"
    names = [f"n{i}" for i in range(args.rounds)]
    cluster = cluster_spec(root, names, bandwidth=f"{bw}", capacity=f"{3 * size}", slots=1)
    rounds = args.rounds

    def spec(src: str, cache: bool) -> object:
        return endpoint_spec(
            "bench",
            src,
            replicas=0,
            max_replicas=rounds,
            cache={"enabled": True} if cache else None,
            time_scale=0.01,
        )

    async with LocalFleet(spec(src1, False), cluster, root / "state") as fleet:  # type: ignore[arg-type]
        for i in range(1, rounds + 1):  # each new replica lands on a node without the model
            await fleet.scale(i)
            await fleet.wait_until(lambda f, i=i: f.ready_count() == i, 600, f"{i} replicas")
        await fleet.scale(0)
        await fleet.wait_until(lambda f: not f.replicas, 120, "scale to 0")
        await fleet.scale(rounds)  # every node now holds the revision
        await fleet.wait_until(lambda f: f.ready_count() == rounds, 600, "warm replicas")
        recs = read_start_records(fleet.events.path)
        cold = [r for r in recs if r.weights_source == "origin" and r.ok]
        warm = [r for r in recs if r.weights_source == "cache" and r.ok]

        await fleet.apply(spec(src1, True))  # type: ignore[arg-type]
        rev1 = fleet.status()["variants"][0]["revision"]
        await fleet.wait_until(
            lambda f: rev1 in f.statuses["main"].gate_open, 600, "cache gate on v1"
        )
        t0 = time.monotonic()
        await fleet.apply(spec(src2, True))  # type: ignore[arg-type]
        rev2 = fleet.status()["variants"][0]["revision"]
        await fleet.wait_until(
            lambda f: (
                f.status()["variants"][0]["stable"] == rev2
                and f.ready_count(revision=rev2) == rounds
            ),
            600,
            "rollout",
        )
        roll_s = time.monotonic() - t0
        per_node = {n: fleet.origin_bytes[(n, rev2)] for n in names}

    cold_ready = percentile([r.ready_seconds or 0 for r in cold], 50)
    warm_ready = percentile([r.ready_seconds or 0 for r in warm], 50)
    shard = changed.stat().st_size
    return {
        "model_bytes": m1.size,
        "shards": args.shards,
        "origin": "nginx" if base else "file",
        "bandwidth_per_node": bw,
        "cold_ready_s": [round(r.ready_seconds or 0, 3) for r in cold],
        "warm_ready_s": [round(r.ready_seconds or 0, 3) for r in warm],
        "cold_weights_s_median": round(
            percentile([r.stage_durations()["weights_ready"] for r in cold], 50), 3
        ),
        "cold_over_warm_ready_median": round(cold_ready / warm_ready, 1),
        "version_change_bytes_per_node": per_node,
        "changed_shard_bytes": shard,
        "version_change_bytes_over_model": round(sum(per_node.values()) / (m1.size * rounds), 4),
        "version_change_exact": all(v == shard for v in per_node.values()),
        "rollout_seconds": round(roll_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--bandwidth", default="100MiB", help="origin limit per node, per second")
    ap.add_argument("--rounds", type=int, default=3, help="cold (and warm) starts measured")
    args = ap.parse_args()
    print("loadavg at start:", Path("/proc/loadavg").read_text().strip())
    root = Path(tempfile.mkdtemp(prefix="preheat-coldstart-"))
    root.chmod(0o755)  # nginx workers run unprivileged
    try:
        with ExitStack() as stack:
            base = None
            if Path(NGINX).exists():
                (root / "origin").mkdir()
                base = stack.enter_context(nginx_origin(root / "origin")).base_url
            result = asyncio.run(run(args, root, base))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=1))
    print(
        f"readiness: cold median {percentile(result['cold_ready_s'], 50):.2f} s "  # type: ignore[arg-type]
        f"vs warm median {percentile(result['warm_ready_s'], 50):.2f} s "  # type: ignore[arg-type]
        f"= {result['cold_over_warm_ready_median']}x; version change moved "
        f"{format_size(sum(result['version_change_bytes_per_node'].values()))} "  # type: ignore[attr-defined]
        f"({result['version_change_bytes_over_model']:.1%} of a full copy per node)"
    )


if __name__ == "__main__":
    main()
