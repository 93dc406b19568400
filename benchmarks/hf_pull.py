"""hf:// pull benchmark: `preheat cache pull hf://...` vs `huggingface_hub.snapshot_download`.

One multi-file model (safetensors shards in LFS plus small git json files and a
tokenizer) is committed to the test Hub (``preheat.testing.hub``: the Hub API, the resolve
redirect and a storage host serving Range, in a child process on 127.0.0.1). Each trial
runs, alternating, as a fresh process:

- ``preheat cache pull hf://acme/bench --store DIR --json`` (default settings: 8
  connections, 32 MiB ranges, sha256 / git blob id verification and fsync before publish);
- ``python -c "huggingface_hub.snapshot_download('acme/bench')"`` with default settings
  (8 worker threads, one stream per file, ``HF_HOME`` under the run's directory).

Both outputs are verified after every trial, outside the clock: each file's sha256 (LFS)
or git blob id (git files) against the Hub's listing. Output directories are emptied and
``sync`` is run before each trial; the Hub's files are in the page cache for every trial.
Prints a Markdown table for docs/benchmarks.md and a JSON line.

    .venv/bin/python benchmarks/hf_pull.py                       # 4 x 75 MB shards, 3 trials
    .venv/bin/python benchmarks/hf_pull.py --shard-size 50MB --trials 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from preheat.config import format_size, parse_size
from preheat.telemetry.stats import percentile
from preheat.testing.hub import HubRepos, HubServer, git_blob_id, hub_server

REPO = "acme/bench"
PREHEAT = str(Path(sys.executable).with_name("preheat"))
HF_CODE = "import huggingface_hub as h, sys; print(h.snapshot_download(sys.argv[1]))"


def build(root: Path, shards: int, shard_size: int) -> tuple[HubRepos, dict[str, Path | bytes]]:
    """The model: ``shards`` safetensors shards (LFS), an index, configs and a tokenizer."""
    src = root / "src"
    src.mkdir(parents=True)
    files: dict[str, Path | bytes] = {}
    for i in range(shards):
        p = src / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with open(p, "wb") as f:
            left = shard_size
            while left:
                n = min(left, 8 << 20)
                f.write(os.urandom(n))
                left -= n
        files[p.name] = p
    weights = {f"layer.{i}.weight": name for i, name in enumerate(sorted(files))}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": weights}).encode()
    files["config.json"] = json.dumps({"hidden_size": 4096, "num_layers": shards}).encode()
    files["generation_config.json"] = b'{"temperature": 0.7}'
    files["tokenizer_config.json"] = b'{"model_max_length": 8192}'
    vocab = {f"tok{i}": i for i in range(120_000)}
    files["tokenizer.json"] = json.dumps({"model": {"vocab": vocab}}).encode()  # ~2 MB, git
    repos = HubRepos(root / "hub")
    repos.commit(REPO, files)
    return repos, files


def verify(snapshot: Path, listing: dict[str, tuple[str, str]]) -> None:
    """Every listed file is there with the Hub's sha256 (LFS) or git blob id; no others."""
    have = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    if have != sorted(listing):
        raise SystemExit(f"{snapshot}: files {have} are not the Hub's {sorted(listing)}")
    for path, (kind, want) in listing.items():
        data = (snapshot / path).read_bytes()
        got = hashlib.sha256(data).hexdigest() if kind == "lfs" else git_blob_id(data)
        if got != want:
            raise SystemExit(f"{snapshot / path}: {kind} {got} is not the Hub's {want}")


def hub_listing(repos: HubRepos) -> dict[str, tuple[str, str]]:
    state = json.loads((repos.root / "state.json").read_text())
    repo = state["repos"][REPO]
    files = repo["commits"][repo["branches"]["main"]]["files"]
    return {p: ("lfs", f["sha256"]) if f["sha256"] else ("git", f["oid"]) for p, f in files.items()}


def run_preheat(hub: HubServer, store: Path) -> tuple[float, Path, float]:
    env = {**os.environ, "HF_ENDPOINT": hub.url}
    t = time.perf_counter()
    out = subprocess.run(
        [PREHEAT, "cache", "pull", f"hf://{REPO}", "--store", str(store), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    wall = time.perf_counter() - t
    res = json.loads(out.stdout)
    return wall, Path(res["snapshot"]), float(res["seconds"])


def run_hf(hub: HubServer, home: Path) -> tuple[float, Path]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home)}
    env.pop("HF_TOKEN", None)
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", HF_CODE, REPO],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    return time.perf_counter() - t, Path(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--shard-size", default="75MB")
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="preheat-hf-bench-"))
    load = Path("/proc/loadavg").read_text().split()[:3]
    try:
        repos, files = build(work, a.shards, parse_size(a.shard_size, what="--shard-size"))
        listing = hub_listing(repos)
        total = sum(p.stat().st_size if isinstance(p, Path) else len(p) for p in files.values())
        times: dict[str, list[float]] = {"preheat": [], "preheat_lib": [], "hf": []}
        with hub_server(repos.root) as hub:
            for trial in range(a.trials):
                order = ("preheat", "hf") if trial % 2 == 0 else ("hf", "preheat")
                for tool in order:
                    for d in ("store", "hf-home"):
                        shutil.rmtree(work / d, ignore_errors=True)
                    os.sync()
                    if tool == "preheat":
                        wall, snap, lib = run_preheat(hub, work / "store")
                        times["preheat_lib"].append(lib)
                    else:
                        wall, snap = run_hf(hub, work / "hf-home")
                    times[tool].append(wall)
                    verify(snap, listing)
                    print(f"trial {trial + 1} {tool}: {wall:.2f} s (verified)", file=sys.stderr)
        med = {k: percentile(v, 50) for k, v in times.items()}
        ratio = med["hf"] / med["preheat"]
        rows = [
            ("huggingface_hub.snapshot_download (defaults)", med["hf"], 1.0),
            ("**preheat cache pull hf://** (verified, fsynced)", med["preheat"], ratio),
        ]
        print(
            f"\nmodel: {len(files)} files, {format_size(total)} ({a.shards} LFS shards of "
            f"{a.shard_size}); loadavg at start {' '.join(load)}; medians of {a.trials}\n"
        )
        print(
            "| pull from the test Hub on 127.0.0.1 | median (process) | throughput | vs snapshot_download |"
        )
        print("|---|---|---|---|")
        for name, sec, r in rows:
            print(f"| {name} | {sec:.2f} s | {total / sec / 1e9:.2f} GB/s | {r:.2f}x |")
        print(f"\npreheat in the library (resolve + fill + publish): {med['preheat_lib']:.2f} s")
        print(
            "per trial: "
            + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in v) for k, v in times.items())
        )
        print(
            json.dumps(
                {
                    "bytes": total,
                    "files": len(files),
                    "load": load,
                    "times": times,
                    "ratio": round(ratio, 3),
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
