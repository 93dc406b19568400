"""Simulated engine benchmark: calibration against its profile, and raw request throughput.

    .venv/bin/python benchmarks/engine_bench.py [--profile llama-3.1-70b-8xh100]
        [--requests 5000] [--concurrency 64]

1. Calibration (``--time-scale 1``): one engine with the profile; sequential single
   requests of 2k/8k/16k unique prompt tokens measure prefill (client-side TTFT vs the
   profile's ``prefill_time``), and 1/16/64 concurrent streams measure decode
   (median inter-token gap vs ``decode_step_time(batch, context)``). Target: within 10 %.
2. Throughput (``--time-scale 0``): a bounded closed-loop load generator (aiohttp,
   ``--concurrency`` in flight, ``--requests`` total, short prompts, 8 output tokens)
   against a fresh engine. Target: >= 500 requests/s with no errors.

Each engine is a separate process (``preheat engine serve``), started and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp

from preheat.engine.client import EngineClient
from preheat.telemetry.stats import percentile
from preheat.testing.engines import simulated_engines
from preheat.timing import get_profile


def unique_prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 127000) for _ in range(n)]


async def calibrate(url: str, profile_name: str) -> dict[str, object]:
    p = get_profile(profile_name)
    rng = random.Random(1)
    out: dict[str, object] = {"prefill": [], "decode": []}
    async with EngineClient(url) as c:
        await c.completion(unique_prompt(64, rng), max_tokens=1)  # warm the connection
        for n in (2048, 8192, 16384):
            ttfts = []
            for _ in range(3):
                r = await c.completion(unique_prompt(n, rng), max_tokens=1)
                ttfts.append(r.ttft_s)
            measured = percentile(ttfts, 50)
            predicted = p.prefill_time(n)
            out["prefill"].append(  # type: ignore[attr-defined]
                {
                    "prompt_tokens": n,
                    "ttft_s": round(measured, 4),
                    "predicted_s": round(predicted, 4),
                    "ratio": round(measured / predicted, 3),
                    "tokens_per_s": round(n / measured),
                }
            )
        prompt_len, max_tokens = 32, 96
        for batch in (1, 16, 64):
            results = await asyncio.gather(
                *(
                    c.completion(unique_prompt(prompt_len, rng), max_tokens=max_tokens, stream=True)
                    for _ in range(batch)
                )
            )
            gaps = sorted(g for r in results for g in r.itl_s[8:])  # skip the admission burst
            measured = percentile(gaps, 50)
            predicted = p.decode_step_time(batch, prompt_len + max_tokens // 2)
            out["decode"].append(  # type: ignore[attr-defined]
                {
                    "batch": batch,
                    "itl_ms": round(measured * 1e3, 3),
                    "predicted_ms": round(predicted * 1e3, 3),
                    "ratio": round(measured / predicted, 3),
                }
            )
    return out


async def throughput(url: str, requests: int, concurrency: int) -> dict[str, object]:
    rng = random.Random(2)
    prompts = [" ".join(f"w{rng.randrange(10**6)}" for _ in range(12)) for _ in range(64)]
    errors = 0
    done = 0
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        it = iter(range(requests))

        async def worker() -> None:
            nonlocal errors, done
            for i in it:
                body = {"prompt": prompts[i % len(prompts)], "max_tokens": 8}
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/completions", json=body) as resp:
                        data = await resp.read()
                        if (
                            resp.status != 200
                            or json.loads(data)["usage"]["completion_tokens"] != 8
                        ):
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1
                lat.append(time.perf_counter() - t0)
                done += 1

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 120)
        elapsed = time.perf_counter() - t0
    return {
        "requests": done,
        "errors": errors,
        "seconds": round(elapsed, 2),
        "requests_per_s": round(done / elapsed, 1),
        "p50_ms": round(percentile(lat, 50) * 1e3, 2),
        "p99_ms": round(percentile(lat, 99) * 1e3, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", default="llama-3.1-70b-8xh100")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    loadavg = Path("/proc/loadavg").read_text().strip()
    print(f"loadavg at start: {loadavg}")

    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()

    with runner:
        with simulated_engines(1, profile=args.profile, time_scale=1.0) as (eng,):
            cal = runner.run(calibrate(eng.url, args.profile))
        print(f"calibration ({args.profile}, --time-scale 1):")
        for row in cal["prefill"]:  # type: ignore[attr-defined]
            print(f"  prefill {row}")
        for row in cal["decode"]:  # type: ignore[attr-defined]
            print(f"  decode  {row}")
        with simulated_engines(1, profile=args.profile, time_scale=0.0) as (eng,):
            thr = runner.run(throughput(eng.url, args.requests, args.concurrency))
        print(f"throughput (--time-scale 0, concurrency {args.concurrency}): {thr}")

    ratios = [r["ratio"] for r in cal["prefill"] + cal["decode"]]  # type: ignore[operator]
    ok_cal = all(0.9 <= float(r) <= 1.1 for r in ratios)
    ok_thr = thr["errors"] == 0 and float(thr["requests_per_s"]) >= 500  # type: ignore[arg-type]
    print(f"calibration within 10 %: {ok_cal}; >= 500 req/s without errors: {ok_thr}")
    if args.json:
        args.json.write_text(
            json.dumps({"loadavg": loadavg, "calibration": cal, "throughput": thr}, indent=2)
        )
    return 0 if ok_cal and ok_thr else 1


if __name__ == "__main__":
    sys.exit(main())
