"""Routing on real engines: 3 llama.cpp servers (-np 2 --cache-ram 0, a tiny model).

Each server holds exactly 2 slots of prompt cache, so a router that keeps each
template on one server reuses it, and one that scatters them recomputes. The same
seeded templated workload (6 templates of ~1,900 tokens, short inputs) goes through
preheat random vs sglang-router random, and preheat prefix_aware vs sglang-router
cache_aware (like with like; sglang-router with its default retries) at concurrency 6;
the cached-token counts are the servers' own (llamacpp:prompt_tokens_cached_total).

    .venv/bin/python benchmarks/router_llamacpp.py --n 150
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from preheat.bench.compare import counterparts
from preheat.bench.routing import drive, engine_counters
from preheat.bench.workloads import templated
from preheat.telemetry.stats import percentile
from preheat.testing.engines import llama_server, llama_server_missing_reason, write_tiny_llama_gguf
from preheat.testing.routers import RouterProcess, launch_router, start_peer_router


@contextlib.contextmanager
def router_for(name: str, urls: list[str], logdir: Path) -> Iterator[RouterProcess]:
    if name.startswith("sglang-"):
        policy = name.partition("-")[2]
        with start_peer_router("sglang", urls, policy=policy, log_path=logdir / f"{name}.log") as r:
            yield r
        return
    strategy, _, knobs = name.partition(":")
    eps, _, lw = knobs.partition(":")
    extra = ["--balance-epsilon", eps] if eps else []
    extra += ["--load-weight", lw] if lw else []
    r = launch_router(
        backends=urls,
        strategy=strategy,
        prefix_length=2048,
        extra_args=extra,
        log_path=logdir / f"{strategy}{knobs}.log",
    )
    try:
        yield r
    finally:
        r.stop()


async def erase(urls: list[str]) -> None:
    """Empty every slot's cache (POST /slots/<id>?action=erase) before a run."""
    async with aiohttp.ClientSession() as s:
        for u in urls:
            for slot in (0, 1):
                async with s.post(f"{u}/slots/{slot}?action=erase") as r:
                    await r.read()


async def one(
    name: str, urls: list[str], items: list[Any], conc: int, logdir: Path
) -> dict[str, Any]:
    await erase(urls)
    with router_for(name, urls, logdir) as r:
        before = await engine_counters(urls)
        outcomes, wall = await drive(r.url, items, concurrency=conc)
        after = await engine_counters(urls)
    hits = sum(after[u].prefix_cache_hits - before[u].prefix_cache_hits for u in urls)
    queries = sum(after[u].prefix_cache_queries - before[u].prefix_cache_queries for u in urls)
    gen = {u: after[u].generation_tokens - before[u].generation_tokens for u in urls}
    total = sum(gen.values()) or 1.0
    ok = [o for o in outcomes if o.status == 200]
    errors = [o.error for o in outcomes if o.status != 200]
    if errors:
        print(f"{name}: {len(errors)} errors, first: {errors[0]}")
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "cached_tokens": hits,
        "prompt_tokens": queries,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        "throughput_rps": len(ok) / wall,
        "max_share_ratio": max(gen.values()) / total * len(urls),
        "errors": len(outcomes) - len(ok),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument(
        "--routers",
        default="random,sglang-random,prefix_aware,prefix_aware:1.0:0.1,sglang-cache_aware",
        help="preheat strategies (strategy[:balance_epsilon[:load_weight]]) and/or "
        "sglang-random, sglang-cache_aware",
    )
    args = ap.parse_args()
    console = Console()
    reason = llama_server_missing_reason()
    if reason:
        console.print(f"skipped: {reason}")
        return
    console.print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    logdir = Path(tempfile.mkdtemp(prefix="router-llamacpp-"))
    model = write_tiny_llama_gguf(logdir / "tiny.gguf")
    items = templated(
        args.n, templates=6, template_chars=2500, user_chars=100, max_tokens=8, seed=2
    )
    for it in items:
        it.body["model"] = "m"
    table = Table(
        title=f"3 llama-server (-np 2 --cache-ram 0), {args.n} templated requests, concurrency {args.concurrency}"
    )
    for col in (
        "router",
        "cached/prompt tokens",
        "hit rate",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "req/s",
        "max share/mean",
        "errors",
    ):
        table.add_column(col, justify="right")
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                llama_server(model, slots=2, ctx_size=8192, alias="m", log_dir=logdir)
            )
            for _ in range(3)
        ]
        urls = [s.url for s in servers]
        results: dict[str, dict[str, Any]] = {}
        for name in args.routers.split(","):
            s = asyncio.run(one(name, urls, items, args.concurrency, logdir))
            results[name] = s
            table.add_row(
                name,
                f"{s['cached_tokens']:.0f}/{s['prompt_tokens']:.0f}",
                f"{s['hit_rate']:.3f}",
                f"{(s['ttft_p50_s'] or 0) * 1e3:.0f}",
                f"{(s['ttft_p90_s'] or 0) * 1e3:.0f}",
                f"{s['throughput_rps']:.1f}",
                f"{s['max_share_ratio']:.2f}",
                str(s["errors"]),
            )
    console.print(table)
    for a, b in counterparts(results, [n for n in results if not n.startswith("sglang")]):
        ra, rb = results[a], results[b]
        console.print(
            f"  {a} vs {b}: hit rate {ra['hit_rate']:.3f} vs {rb['hit_rate']:.3f}, "
            f"TTFT p50 {(ra['ttft_p50_s'] or 0) * 1e3:.0f} vs {(rb['ttft_p50_s'] or 0) * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
