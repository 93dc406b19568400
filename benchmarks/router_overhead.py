"""Latency a router adds in front of fast backends on 127.0.0.1, side by side with peers.

Two fast fake OpenAI backends (own processes, uvloop) answer at once. The same
non-streaming /v1/completions requests (a ~2,000-character prompt from a few shared
prefixes) go directly to the backends (round robin) and through each router:
preheat (random and prefix_aware), sglang-router and vllm-router (cache_aware), at
concurrency 1 and 32. Reports p50/p99 latency, the added latency against direct, and
ratios of preheat's added latency to each peer's.

    .venv/bin/python benchmarks/router_overhead.py --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from preheat.testing.routers import (
    RouterProcess,
    launch_router,
    start_fast_backend,
    start_peer_router,
)

ROUTERS = ("preheat-random", "preheat-prefix_aware", "sglang-cache_aware", "vllm-cache_aware")


def bodies(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    shared = ["".join(rng.choice("abcdefgh ijklm") for _ in range(1800)) for _ in range(8)]
    return [
        json.dumps(
            {"model": "fake", "prompt": rng.choice(shared) + f" question {i}", "max_tokens": 3}
        ).encode()
        for i in range(n)
    ]


ERRORS: dict[str, int] = {}


async def measure(
    urls: list[str], data: list[bytes], concurrency: int, name: str = ""
) -> list[float]:
    """Per-request latency in seconds of the answers with status 200 (others are counted
    in ``ERRORS[name]``: a peer's circuit breaker may answer 503); ``urls`` round robin."""
    out: list[float] = []
    it = iter(enumerate(data))
    conn = aiohttp.TCPConnector(limit=0)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=conn) as s:
        # Warm up connections.
        for u in urls:
            for _ in range(concurrency):
                async with s.post(u + "/v1/completions", data=data[0], headers=headers) as r:
                    await r.read()

        async def worker() -> None:
            for i, body in it:
                t0 = time.perf_counter()
                async with s.post(
                    urls[i % len(urls)] + "/v1/completions", data=body, headers=headers
                ) as r:
                    await r.read()
                if r.status != 200:
                    ERRORS[f"{name} c={concurrency}"] = ERRORS.get(f"{name} c={concurrency}", 0) + 1
                    continue
                out.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(out)


@contextlib.contextmanager
def router(name: str, backends: list[str], logdir: Path) -> Iterator[RouterProcess]:
    kind, policy = name.split("-", 1)
    if kind == "preheat":
        r = launch_router(backends=backends, strategy=policy, log_path=logdir / f"{name}.log")
        try:
            yield r
        finally:
            r.stop()
    else:
        with start_peer_router(kind, backends, policy=policy, log_path=logdir / f"{name}.log") as r:
            yield r


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="per router and concurrency")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    console = Console()
    console.print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    logdir = Path("/tmp/router-overhead")
    logdir.mkdir(exist_ok=True)
    data = bodies(args.requests, 1)
    results: dict[str, Any] = {}
    with start_fast_backend() as b1, start_fast_backend() as b2:
        backends = [b1.url, b2.url]
        for conc in (int(c) for c in args.concurrency.split(",")):
            res: dict[str, list[float]] = {"direct": asyncio.run(measure(backends, data, conc))}
            for name in args.routers.split(","):
                with router(name, backends, logdir) as r:
                    res[name] = asyncio.run(measure([r.url], data, conc, name))
            results[conc] = res
    for conc, res in results.items():
        d50, d99 = pct(res["direct"], 0.5), pct(res["direct"], 0.99)
        table = Table(title=f"concurrency {conc}, {args.requests} requests (ms)")
        for col in ("path", "p50", "p99", "added p50", "added p99", "req/s"):
            table.add_column(col, justify="right")
        for name, xs in res.items():
            p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
            rps = len(xs) / sum(xs) * conc
            table.add_row(
                name,
                f"{p50 * 1e3:.3f}",
                f"{p99 * 1e3:.3f}",
                "-" if name == "direct" else f"{(p50 - d50) * 1e3:.3f}",
                "-" if name == "direct" else f"{(p99 - d99) * 1e3:.3f}",
                f"{rps:.0f}",
            )
        console.print(table)
        for ours, peer in itertools.product(
            [n for n in res if n.startswith("preheat")],
            [n for n in res if not n.startswith(("preheat", "direct"))],
        ):
            a = pct(res[ours], 0.5) - d50
            b = pct(res[peer], 0.5) - d50
            a99 = pct(res[ours], 0.99) - d99
            b99 = pct(res[peer], 0.99) - d99
            console.print(
                f"  c={conc}: {ours} added p50 {a * 1e3:.3f} ms = {a / b:.2f}x {peer}; "
                f"added p99 {a99 * 1e3:.3f} ms = {a99 / b99 if b99 > 0 else float('nan'):.2f}x"
            )
    for what, count in ERRORS.items():
        console.print(f"  {what}: {count} non-200 answers (left out of the latencies)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    str(c): {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in r.items()}
                    for c, r in results.items()
                }
            )
        )


if __name__ == "__main__":
    main()
