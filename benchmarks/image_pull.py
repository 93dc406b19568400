"""Image pull benchmark: preheat's image cache vs ``skopeo copy`` from the same registry.

One run, like with like: an image of ``--size`` (default 1 GiB) in ``--layers`` layers
is written as an OCI layout, pushed to Debian's docker-registry (distribution 2.8,
filesystem storage) on 127.0.0.1 with skopeo, then pulled ``--trials`` times by each
tool, alternating, every trial into an empty destination after ``sync``:

- preheat: ``ImageCache.pull`` into a fresh store (ranged parallel fetch, sha256 of every
  blob, fsync, an OCI layout view published atomically).
- skopeo: ``skopeo copy docker://127.0.0.1:P/bench/img:v1 oci:DIR`` (skopeo checks every
  blob's digest too; it does not fsync, so preheat pays for durability skopeo skips).

A last row: a second image that shares all but one layer, pulled into the warm store
(bytes fetched vs bytes of the new layer). Prints a Markdown section for
docs/benchmarks.md and a JSON line.

    .venv/bin/python benchmarks/image_pull.py                 # 1 GiB, 8 layers, 3 trials
    .venv/bin/python benchmarks/image_pull.py --size 256MiB --trials 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from preheat.config import format_size, parse_size
from preheat.images import ImageCache
from preheat.store import NodeStore
from preheat.telemetry.stats import percentile
from preheat.testing.registry import registry, skopeo, write_layout


def _sync() -> None:
    subprocess.run(["sync"], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--connections", type=int, default=8)
    args = ap.parse_args()
    total = parse_size(args.size)
    per = total // args.layers
    sizes = [per] * args.layers
    base = Path(tempfile.mkdtemp(prefix="preheat-image-bench-"))
    try:
        t0 = time.monotonic()
        layout = write_layout(base / "layout", sizes, seed=1)
        # the second image: the same layers but the last (a new top layer)
        layout2 = write_layout(base / "layout2", [*sizes[:-1], per + 4096], seed=1)
        results: dict[str, list[float]] = {"preheat": [], "skopeo": []}
        with registry(base / "reg") as reg:
            reg.push(layout.path, "bench/img:v1")
            reg.push(layout2.path, "bench/img:v2")
            setup = time.monotonic() - t0
            ref = reg.ref("bench/img:v1")
            for trial in range(args.trials):
                order = ["preheat", "skopeo"] if trial % 2 == 0 else ["skopeo", "preheat"]
                for tool in order:
                    dest = base / f"{tool}-{trial}"
                    _sync()
                    t = time.monotonic()
                    if tool == "preheat":
                        got = ImageCache(NodeStore(dest)).pull(ref, connections=args.connections)
                        assert got.digest == layout.digest
                    else:
                        skopeo(
                            "copy", "--src-tls-verify=false", f"docker://{ref}", f"oci:{dest}:v1"
                        )
                    results[tool].append(time.monotonic() - t)
                    if trial < args.trials - 1 or tool == "skopeo":
                        shutil.rmtree(dest, ignore_errors=True)
            warm = ImageCache(NodeStore(base / f"preheat-{args.trials - 1}"))
            second = warm.pull(reg.ref("bench/img:v2"), connections=args.connections)
        load = os.getloadavg()
        med = {k: percentile(v, 50) for k, v in results.items()}
        ratio = med["skopeo"] / med["preheat"]
        size = layout.images["linux/amd64"].size
        out = {
            "size": size,
            "layers": args.layers,
            "trials": args.trials,
            "preheat_s": results["preheat"],
            "skopeo_s": results["skopeo"],
            "median_preheat_s": med["preheat"],
            "median_skopeo_s": med["skopeo"],
            "ratio": ratio,
            "second_image_fetched": second.bytes_fetched,
            "second_image_reused": second.bytes_reused,
            "load": load,
            "setup_s": setup,
        }
        gib = size / 2**30
        print(
            f"### Image pull ({format_size(size)} in {args.layers} layers, {args.trials} trials)\n"
        )
        print("| tool | median s | GiB/s | trials s |")
        print("|---|---|---|---|")
        for k in ("preheat", "skopeo"):
            trials = ", ".join(f"{x:.2f}" for x in results[k])
            print(f"| {k} | {med[k]:.2f} | {gib / med[k]:.2f} | {trials} |")
        print(
            f"\nratio skopeo/preheat: **{ratio:.2f}x**; second image sharing "
            f"{args.layers - 1} of {args.layers} layers: fetched "
            f"{format_size(second.bytes_fetched)}, reused {format_size(second.bytes_reused)}; "
            f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}\n"
        )
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
