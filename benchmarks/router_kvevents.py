"""KV hit rate of ``prefix_aware`` with KV events on vs off, against the oracle bound.

Simulated engines (70B profile, time-scaled) with ``--kv-events`` and a small KV cache
(the prefix working set exceeds one engine's), the same seeded stream through a router
that subscribes to the events and through one that does not (learned index only), in
one run. The hit rate is the engines' own counters; the oracle is one unbounded cache
that sees every request (``oracle_hit_rate``); ``pooled`` is one LRU cache of the
fleet's whole KV memory (instances x blocks) fed the stream in order, the bound a
perfect partition of the working set would approach. From each router's decision log:
its own decision time (``decision_us``, the tokenizer included with events on) and how
far its predicted cached tokens were from what the engines reported.

    .venv/bin/python benchmarks/router_kvevents.py --workload rag_chat --n 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from preheat.bench.routing import (
    drive,
    engine_counters,
    oracle_hit_rate,
    prompt_tokens,
    reset_caches,
    summarize,
)
from preheat.bench.workloads import WORKLOADS
from preheat.engine.core.tokenizer import Tokenizer
from preheat.kvcache import KVCache
from preheat.runtime.procs import free_port
from preheat.telemetry.routing import read_decisions
from preheat.telemetry.stats import percentile
from preheat.testing.engines import EngineProcess, start_simulated_engine
from preheat.testing.routers import launch_router


async def _run(
    urls: list[str], items: list[Any], concurrency: int, extra: list[str], logdir: Path, name: str
) -> dict[str, Any]:
    dlog = logdir / f"{name}.decisions.jsonl"
    r = launch_router(
        backends=urls,
        strategy="prefix_aware",
        extra_args=extra,
        log_path=logdir / f"{name}.log",
        decision_log=dlog,
    )
    try:
        time.sleep(1.0)  # subscriptions land; the reset's AllBlocksCleared syncs the index
        await reset_caches(urls)
        time.sleep(0.5)
        before = await engine_counters(urls)
        outcomes, wall = await drive(r.url, items, concurrency=concurrency)
        await asyncio.sleep(0.3)
        after = await engine_counters(urls)
        with urllib.request.urlopen(r.url + "/metrics") as resp:
            text = resp.read().decode()
        synced = sum(
            1
            for line in text.splitlines()
            if line.startswith("preheat_router_kv_events_state{")
            and 'state="synced"' in line
            and line.endswith(" 1.0")
        )
    finally:
        r.stop()
    out = summarize(outcomes, wall, before, after)
    out["synced_instances"] = synced
    ds = [d for d in read_decisions(dlog) if d.actual_cached_tokens is not None]
    us = sorted(d.decision_us for d in ds)
    err = [abs((d.predicted_cached_tokens or 0) - (d.actual_cached_tokens or 0)) for d in ds]
    prm = sum(d.prompt_tokens or 0 for d in ds) or 1
    out["decision_us_p50"] = percentile(us, 50) if us else None
    out["decision_us_p99"] = percentile(us, 99) if us else None
    out["prediction_error_share"] = sum(err) / prm
    return out


def pooled_hit_rate(items: list[Any], blocks: int, block_size: int = 16) -> float:
    """Hit rate of one LRU cache of ``blocks`` blocks fed the stream in order."""
    kv = KVCache(blocks, block_size)
    tok = Tokenizer()
    for k, item in enumerate(items):
        toks = prompt_tokens(item, tok)
        hashes = kv.hashes(toks)
        if kv.allocate_prompt(k, hashes, len(toks), len(toks)) is not None:
            kv.commit(k, hashes, len(toks))
            kv.free(k)
    return kv.stats().hit_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="rag_chat", choices=sorted(WORKLOADS))
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=600)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    logdir = Path(tempfile.mkdtemp(prefix="router-kvevents-"))
    engines: list[EngineProcess] = []
    eps: list[str] = []
    try:
        for _ in range(args.instances):
            ep = f"tcp://127.0.0.1:{free_port()}"
            eps.append(ep)
            engines.append(
                start_simulated_engine(
                    log_dir=logdir,
                    profile="llama-3.1-70b-8xh100",
                    time_scale=args.time_scale,
                    kv_blocks=args.kv_blocks,
                    model_name="m",
                    extra=["--kv-events", ep],
                )
            )
        urls = [e.url for e in engines]
        items = WORKLOADS[args.workload](args.n, seed=args.seed)
        oracle = oracle_hit_rate(items)
        pooled = pooled_hit_rate(items, args.kv_blocks * args.instances)
        print(f"{args.workload}: oracle {oracle:.3f}, pooled KV memory bound {pooled:.3f}")
        on = [a for u, ep in zip(urls, eps, strict=True) for a in ("--kv-events", f"{u}={ep}")]
        res: dict[str, Any] = {
            "args": vars(args) | {"json": str(args.json)},
            "oracle": oracle,
            "pooled": pooled,
        }
        for name, extra in (("events_off", []), ("events_on", on)):
            s = asyncio.run(_run(urls, items, args.concurrency, extra, logdir, name))
            res[name] = s
            print(
                f"{args.workload} {name}: hit rate {s['hit_rate']:.3f} "
                f"({s['hit_rate'] / oracle:.2f} of oracle {oracle:.3f}), "
                f"TTFT p90 {(s['ttft_p90_s'] or 0) * 1e3:.0f} ms, max share "
                f"{s['max_share_ratio']:.2f}, errors {s['errors']}, "
                f"synced instances at the end {s['synced_instances']}, decision p50/p99 "
                f"{s['decision_us_p50'] or 0:.0f}/{s['decision_us_p99'] or 0:.0f} us, predicted "
                f"cached tokens off by {s['prediction_error_share']:.3f} of prompt tokens"
            )
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
    finally:
        for e in engines:
            e.stop()


if __name__ == "__main__":
    main()
