"""`preheat demo`'s traffic: RAG-style prompts and the routing comparison's numbers.

The prompts are documents with Zipf-like popularity plus a unique question; a run sends
them through the router and measures TTFT at the client and KV hit rate and per-replica
shares from the engines' own ``/metrics`` (deltas over the run).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import aiohttp

from preheat.runtime.local import LocalFleet
from preheat.telemetry.stats import percentile

__all__ = ["documents", "traffic", "workload"]


def documents(n: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [
        "cache", "node", "replica", "weights", "shard", "router", "prefix", "token", "latency",
        "origin", "bandwidth", "snapshot", "revision", "lease", "eviction", "warm", "cold",
        "kernel", "tensor", "batch", "decode", "prefill", "block", "hash", "policy", "fleet",
    ]  # fmt: skip
    docs = []
    for i in range(n):
        body = " ".join(rng.choice(words) for _ in range(chars // 6))
        docs.append(f"Document {i}: {body}"[:chars])
    return docs


def workload(n: int, docs: list[str], seed: int) -> list[str]:
    """RAG-style prompts: a document (Zipf-like popularity) plus a unique question."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 0.8 for i in range(len(docs))]
    out = []
    for i in range(n):
        d = rng.choices(range(len(docs)), weights)[0]
        out.append(f"{docs[d]}\n\nQuestion {i}: what does the document say about item {i}?")
    return out


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _engine_counters(
    session: aiohttp.ClientSession, urls: dict[str, str]
) -> dict[str, tuple[float, float, float]]:
    """replica -> (prefix cache queries, hits, finished requests) from its /metrics."""
    out = {}
    for rid, url in urls.items():
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        out[rid] = (
            _metric_sum(text, "vllm:prefix_cache_queries_total"),
            _metric_sum(text, "vllm:prefix_cache_hits_total"),
            _metric_sum(text, "vllm:e2e_request_latency_seconds_count"),
        )
    return out


async def traffic(fleet: LocalFleet, prompts: list[str], concurrency: int) -> dict[str, Any]:
    """Send ``prompts`` through the router; TTFT from the client, hits and shares from
    the engines' own counters (deltas over this run)."""
    urls = {r["id"]: r["url"] for r in fleet.status()["replicas"] if r["phase"] == "ready"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for url in urls.values():
            async with session.post(f"{url}/reset_prefix_cache") as resp:
                await resp.read()
        before = await _engine_counters(session, urls)
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        ttft: list[float] = []
        failed = 0

        async def worker() -> None:
            nonlocal failed
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {
                    "model": fleet.spec.name,
                    "prompt": prompt,
                    "max_tokens": 16,
                    "stream": True,
                    # The usage chunk carries the engine's cached_tokens, which the router
                    # writes into its decision log next to its own prediction.
                    "stream_options": {"include_usage": True},
                }
                t0 = time.monotonic()
                first = None
                try:
                    async with session.post(
                        f"{fleet.router.url}/v1/completions", json=body
                    ) as resp:
                        async for chunk in resp.content.iter_any():
                            if first is None and chunk:
                                first = time.monotonic()
                        if resp.status != 200:
                            failed += 1
                            continue
                except (aiohttp.ClientError, TimeoutError):
                    failed += 1
                    continue
                if first is not None:
                    ttft.append(first - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        after = await _engine_counters(session, urls)
    queries = sum(after[r][0] - before[r][0] for r in urls)
    hits = sum(after[r][1] - before[r][1] for r in urls)
    done = {r: after[r][2] - before[r][2] for r in urls}
    total = sum(done.values()) or 1.0
    return {
        "requests": len(prompts),
        "failed": failed,
        "ttft_p50_ms": round(1000 * percentile(ttft, 50), 2) if ttft else None,
        "ttft_p90_ms": round(1000 * percentile(ttft, 90), 2) if ttft else None,
        "kv_hit_rate": round(hits / queries, 4) if queries else None,
        "shares": {r: round(n / total, 4) for r, n in sorted(done.items())},
    }
