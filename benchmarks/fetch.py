"""Model store fill benchmark: preheat vs aria2c and curl from nginx on 127.0.0.1.

Measures, in one run against the same files:

1. Fill of one 2 GiB file (verification and fsync included for preheat) against
   ``aria2c -x8 -s8`` and ``curl -o FILE``; trials alternate tools, medians reported.
2. Fill of a 2 GiB model in 8 shards (preheat vs aria2c with the same 8 URLs, and curl
   fetching them one after another).
3. Re-pull of the present revision: bytes fetched and seconds.
4. A new revision that changes 1 of the 8 shards: bytes fetched vs that shard's size.
5. Read-back of the snapshot (read every file in 16 MiB reads, what an engine's loader
   does) vs ``dd bs=16M`` on the same files, cold (pages dropped with
   ``posix_fadvise(DONTNEED)``, only for these files) and warm.

Every trial starts after ``sync`` so earlier dirty pages do not bill the next tool.
Prints a Markdown section for docs/benchmarks.md and a JSON line.

    .venv/bin/python benchmarks/fetch.py                  # 2 GiB, 3 trials
    .venv/bin/python benchmarks/fetch.py --size 512MiB --trials 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from preheat.bench.models import generate_model, rewrite_shard, shard_paths, write_http_manifest
from preheat.config import format_size, parse_size
from preheat.store import NodeStore
from preheat.telemetry.stats import percentile
from preheat.testing.origins import nginx_origin


def _drop(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd) if os.access(p, os.W_OK) else None
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def _timed(fn: Callable[[], object]) -> float:
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _curl_outputs(out: Path, files: list[Path], urls: list[str]) -> list[str]:
    args: list[str] = []
    for p, u in zip(files, urls, strict=True):
        args += ["-o", str(out / p.name), u]
    return args


def read_back(paths: list[Path]) -> int:
    """Read every file start to end in 16 MiB reads into one buffer (a loader's pattern)."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="model size (default 2GiB)")
    ap.add_argument("--trials", type=int, default=3, help="alternating trials per tool")
    ap.add_argument("--workdir", default=None, help="scratch dir on the disk to test")
    ap.add_argument("--connections", type=int, default=8)
    args = ap.parse_args()
    size = parse_size(args.size)
    load = Path("/proc/loadavg").read_text().strip()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="preheat-fetch-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    origin = work / "origin"
    results: dict[str, object] = {"size": size, "loadavg": load, "trials": args.trials}
    try:
        generate_model(origin / "one", size, 1, seed=1)
        write_http_manifest(origin / "one")
        generate_model(origin / "eight", size, 8, seed=2)
        write_http_manifest(origin / "eight")
        one = shard_paths(origin / "one")[0]
        eight = shard_paths(origin / "eight")
        out = work / "out"
        with nginx_origin(origin) as o:
            _warm([one, *eight])  # the origin serves from its page cache in every trial
            url_one = o.url(f"one/{one.name}")
            urls_eight = [o.url(f"eight/{p.name}") for p in eight]
            times: dict[str, list[float]] = {}

            def fresh() -> Path:
                """The output dir; emptied by the trial loop before the clock starts."""
                out.mkdir(parents=True, exist_ok=True)
                return out

            def pull(ref: str) -> None:
                fresh()
                NodeStore(out / "store").pull(ref, connections=args.connections)

            def pull_nofsync(ref: str) -> None:
                fresh()
                NodeStore(out / "store", fsync=False).pull(ref, connections=args.connections)

            cases: dict[str, Callable[[], object]] = {
                "one/preheat": lambda: pull(o.url("one/preheat-manifest.json")),
                "one/preheat-nofsync": lambda: pull_nofsync(o.url("one/preheat-manifest.json")),
                "one/aria2c": lambda: _run(
                    [
                        "aria2c",
                        "-q",
                        "-x8",
                        "-s8",
                        "--allow-overwrite=true",
                        "-d",
                        str(fresh()),
                        "-o",
                        "f",
                        url_one,
                    ]
                ),
                "one/curl": lambda: _run(["curl", "-s", "-f", "-o", str(fresh() / "f"), url_one]),
                "eight/preheat": lambda: pull(o.url("eight/preheat-manifest.json")),
                "eight/aria2c": lambda: _run(
                    [
                        "aria2c",
                        "-q",
                        "-x8",
                        "-s8",
                        "-j8",
                        "--allow-overwrite=true",
                        "-d",
                        str(fresh()),
                        "-Z",
                        *urls_eight,
                    ]
                ),
                "eight/curl": lambda: _run(
                    ["curl", "-s", "-f", *_curl_outputs(fresh(), eight, urls_eight)]
                ),
            }
            for trial in range(args.trials):
                for name, fn in cases.items():
                    shutil.rmtree(out, ignore_errors=True)  # outside the timed part
                    times.setdefault(name, []).append(_timed(fn))
                    print(f"trial {trial + 1} {name}: {times[name][-1]:.2f} s", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            med = {k: percentile(v, 50) for k, v in times.items()}
            results["fill_seconds_median"] = med
            results["fill_seconds_all"] = times

            # re-pull, one-shard change, read-back on a kept store
            store = NodeStore(work / "store")
            first = store.pull(o.url("eight/preheat-manifest.json"))
            again = store.pull(o.url("eight/preheat-manifest.json"))
            cli = Path(sys.executable).with_name("preheat")
            t = time.perf_counter()
            subprocess.run(
                [
                    str(cli),
                    "cache",
                    "pull",
                    o.url("eight/preheat-manifest.json"),
                    "--store",
                    str(work / "store"),
                    "--json",
                ],
                check=True,
                capture_output=True,
            )
            results["repull_cli_seconds"] = time.perf_counter() - t
            changed = rewrite_shard(origin / "eight", 3, seed=2)
            write_http_manifest(origin / "eight")
            v2 = store.pull(o.url("eight/preheat-manifest.json"))
            results["repull"] = {"seconds": again.seconds, "bytes_fetched": again.bytes_fetched}
            results["one_shard_change"] = {
                "bytes_fetched": v2.bytes_fetched,
                "shard_size": changed.stat().st_size,
                "seconds": v2.seconds,
            }
            files = sorted(p for p in first.snapshot.iterdir() if p.is_file())
            rb: dict[str, list[float]] = {
                "cold/preheat": [],
                "cold/dd": [],
                "warm/preheat": [],
                "warm/dd": [],
            }
            for _ in range(args.trials):
                for mode in ("cold", "warm"):
                    for tool in ("preheat", "dd"):
                        if mode == "cold":
                            _drop(files)
                        else:
                            _warm(files)
                        if tool == "preheat":
                            rb[f"{mode}/{tool}"].append(_timed(lambda: read_back(files)))
                        else:
                            rb[f"{mode}/{tool}"].append(
                                _timed(
                                    lambda: [
                                        _run(["dd", f"if={p}", "of=/dev/null", "bs=16M"])
                                        for p in files
                                    ]
                                )
                            )
            results["read_back_seconds_median"] = {k: percentile(v, 50) for k, v in rb.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = results["fill_seconds_median"]  # type: ignore[assignment]
    assert isinstance(med, dict)
    gb = size / 1e9

    def row(name: str, base: str) -> str:
        return (
            f"| {name} | {med[name]:.2f} s | {gb / med[name]:.2f} GB/s | "
            f"{med[base] / med[name]:.2f}x |"
        )

    rbm = results["read_back_seconds_median"]  # type: ignore[assignment]
    assert isinstance(rbm, dict)
    rp = results["repull"]
    osc = results["one_shard_change"]
    assert isinstance(rp, dict) and isinstance(osc, dict)
    print()
    print(
        f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `/proc/loadavg` at start `{load}`,"
    )
    print(
        f"model {format_size(size)}, medians of {args.trials} alternating trials, `sync` before each.\n"
    )
    print("| fill from nginx on 127.0.0.1 | median | throughput | vs aria2c -x8 -s8 |")
    print("|---|---|---|---|")
    for name in ("one/aria2c", "one/curl", "one/preheat", "one/preheat-nofsync"):
        print(row(name, "one/aria2c"))
    for name in ("eight/aria2c", "eight/curl", "eight/preheat"):
        print(row(name, "eight/aria2c"))
    print()
    print(
        f"preheat vs curl: one file {med['one/curl'] / med['one/preheat']:.2f}x, "
        f"8 shards {med['eight/curl'] / med['eight/preheat']:.2f}x (preheat verified + fsynced, curl neither)."
    )
    cli_s = float(str(results["repull_cli_seconds"]))
    print(
        f"Re-pull of the present revision: {rp['bytes_fetched']} bytes fetched, "
        f"{rp['seconds'] * 1000:.0f} ms in the library, {cli_s * 1000:.0f} ms as "
        "`preheat cache pull` (process start included)."
    )
    print(
        f"New revision changing 1 of 8 shards: fetched {osc['bytes_fetched']} bytes; "
        f"the shard is {osc['shard_size']} bytes ({osc['seconds']:.2f} s)."
    )
    for mode in ("cold", "warm"):
        r = rbm[f"{mode}/dd"] / rbm[f"{mode}/preheat"]
        print(
            f"Read-back {mode}: snapshot {gb / rbm[f'{mode}/preheat']:.2f} GB/s vs dd bs=16M "
            f"{gb / rbm[f'{mode}/dd']:.2f} GB/s = {r:.0%} of dd."
        )
    print()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
