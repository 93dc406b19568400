"""`oci://` pull cost by ModelPack layer format: raw layers vs tar vs tar+zstd vs tar+gzip.

One run, like with like: a model of ``--size`` in ``--files`` files (random bytes) is
pushed to Debian's docker-registry on 127.0.0.1 three times, as ``weight.v1.raw`` layers
(one per file), ``weight.v1.tar`` layers and ``weight.v1.tar+zstd`` layers. Each is
pulled ``--trials`` times with ``NodeStore.pull`` into an empty store, alternating the
formats, after ``sync``. A raw layer goes straight into the store over ranged parallel
GETs; a tar layer is downloaded whole, verified, and read in place (plain tar: its
members copied into the store) or unpacked into staging (tar+zstd, tar+gzip: the
staged files hard-linked into the store). A last row: the tar model's second revision (one file changed) pulled
into the warm store. Prints a Markdown table and a JSON line.

    .venv/bin/python benchmarks/oci_tar_pull.py                  # 256 MiB, 4 files, 3 trials
    .venv/bin/python benchmarks/oci_tar_pull.py --size 1GiB --trials 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from preheat.config import format_size, parse_size
from preheat.store import NodeStore
from preheat.telemetry.stats import percentile
from preheat.testing.registry import ModelLayer, registry, tar_layer

WEIGHT = "application/vnd.cncf.model.weight.v1"
FORMATS = {"raw": ".raw", "tar": ".tar", "tar+zstd": ".tar+zstd", "tar+gzip": ".tar+gzip"}


def _layers(files: dict[str, bytes], fmt: str) -> list[ModelLayer]:
    out = []
    for name, data in files.items():
        ann = {"org.cncf.model.filepath": name}
        if fmt == "raw":
            out.append(ModelLayer(WEIGHT + ".raw", data, ann))
        else:
            comp = fmt.partition("+")[2]
            out.append(ModelLayer(WEIGHT + FORMATS[fmt], tar_layer([(name, data)], comp), ann))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="comma-separated layer formats to pull (raw is always one: the baseline)",
    )
    args = ap.parse_args()
    formats = ["raw", *(f for f in args.formats.split(",") if f in FORMATS and f != "raw")]
    per = parse_size(args.size) // args.files
    rng = random.Random(7)
    files = {f"model-{i:05d}.safetensors": rng.randbytes(per) for i in range(args.files)}
    base = Path(tempfile.mkdtemp(prefix="preheat-ocitar-bench-"))
    seconds: dict[str, list[float]] = {f: [] for f in formats}
    try:
        with registry(base / "reg") as reg:
            for fmt in formats:
                reg.push_model_layers(f"bench/model:{fmt.replace('+', '-')}", _layers(files, fmt))
            changed = {**files, next(iter(files)): rng.randbytes(per)}
            reg.push_model_layers("bench/model:tar-v2", _layers(changed, "tar"))
            for trial in range(args.trials):
                for fmt in formats:
                    store = base / f"store-{fmt}-{trial}"
                    subprocess.run(["sync"], check=False)
                    t0 = time.monotonic()
                    NodeStore(store).pull(
                        f"oci://{reg.ref('bench/model:' + fmt.replace('+', '-'))}"
                    )
                    seconds[fmt].append(time.monotonic() - t0)
                    if not (fmt == "tar" and trial == args.trials - 1):
                        shutil.rmtree(store)
            second, v2 = None, 0.0
            if "tar" in formats:
                warm = NodeStore(base / f"store-tar-{args.trials - 1}")
                t0 = time.monotonic()
                second = warm.pull(f"oci://{reg.ref('bench/model:tar-v2')}")
                v2 = time.monotonic() - t0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    raw = percentile(seconds["raw"], 50)
    load = os.getloadavg()[0]
    print(
        f"model {format_size(per * args.files)} in {args.files} files, {args.trials} trials, load {load:.1f}"
    )
    print("| layers | median s | vs raw |")
    print("|---|---|---|")
    for fmt, xs in seconds.items():
        med = percentile(xs, 50)
        print(f"| {fmt} | {med:.2f} | {med / raw:.2f}x |")
    if second is not None:
        print(
            f"second tar revision (1 of {args.files} files changed): {v2:.2f} s, fetched "
            f"{format_size(second.bytes_fetched)}, reused {format_size(second.bytes_reused)}"
        )
    print(
        json.dumps(
            {
                "size": per * args.files,
                "seconds": seconds,
                "second_revision": second
                and {"seconds": v2, "bytes_fetched": second.bytes_fetched},
                "load": load,
            }
        )
    )


if __name__ == "__main__":
    main()
