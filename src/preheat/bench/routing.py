"""Runners for the routing comparison: drive a workload through a router, read the engines.

``drive`` sends a workload's requests (streaming, with usage) through any
OpenAI-compatible router at a fixed concurrency and records TTFT, latency, the engine's
cached tokens and the instance (from ``X-Preheat-Instance`` when the router sets it).
``engine_counters`` reads the engines' own ``/metrics`` (KV hits and queries, finished
requests per engine) so that every router, ours or a peer, is judged by the engines.
``oracle_hit_rate`` is the bound a router that knew every cache could reach: the
share of prompt tokens whose KV blocks any earlier request already produced (one
unbounded fleet-wide cache, the engine's own tokenizer, chat template and block hashes).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from preheat.bench.workloads import CHAT, WorkItem
from preheat.engine.client import EngineClient, EngineMetrics
from preheat.engine.core.chat import render_chat
from preheat.engine.core.tokenizer import Tokenizer
from preheat.kvcache import block_hashes
from preheat.telemetry.stats import percentile


@dataclass(frozen=True)
class Outcome:
    """What happened to one request."""

    request_id: str
    group: str
    status: int
    ttft_s: float | None
    e2e_s: float
    instance: str | None
    cached_tokens: int | None
    prompt_tokens: int | None
    error: str | None = None


async def send_one(
    session: aiohttp.ClientSession, base_url: str, item: WorkItem, headers: Mapping[str, str]
) -> Outcome:
    """Send one request (streaming, with usage) and record what happened; never raises
    for an HTTP or transport failure (status 0 with the error instead)."""
    body = dict(item.body)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] | None = None
    try:
        async with session.post(
            base_url + item.path,
            json=body,
            headers={"X-Request-Id": item.request_id, **headers},
        ) as resp:
            instance = resp.headers.get("X-Preheat-Instance")
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")[:200]
                return Outcome(
                    item.request_id, item.group, resp.status, None,
                    time.perf_counter() - t0, instance, None, None, text,
                )  # fmt: skip
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                doc = json.loads(data)
                if ttft is None and _has_token(doc):
                    ttft = time.perf_counter() - t0
                if doc.get("usage"):
                    usage = doc["usage"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(
            item.request_id, item.group, 0, None, time.perf_counter() - t0, None, None, None,
            repr(exc),
        )  # fmt: skip
    details = (usage or {}).get("prompt_tokens_details") or {}
    return Outcome(
        request_id=item.request_id,
        group=item.group,
        status=200,
        ttft_s=ttft,
        e2e_s=time.perf_counter() - t0,
        instance=instance,
        cached_tokens=details.get("cached_tokens"),
        prompt_tokens=(usage or {}).get("prompt_tokens"),
    )


def _has_token(doc: Mapping[str, Any]) -> bool:
    """Whether an SSE chunk carries generated text (not the opening role-only delta)."""
    for c in doc.get("choices") or ():
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False


async def drive(
    base_url: str,
    items: Sequence[WorkItem],
    *,
    concurrency: int,
    timeout_s: float = 120.0,
    headers: Mapping[str, str] | None = None,
) -> tuple[list[Outcome], float]:
    """Send ``items`` in order with ``concurrency`` workers; returns outcomes and wall time.

    A chat turn waits for its conversation's previous turn (``WorkItem.after``).
    """
    done: dict[str, asyncio.Event] = {i.request_id: asyncio.Event() for i in items}
    queue = list(reversed(items))
    out: list[Outcome] = []
    hdrs = dict(headers or {})
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def worker() -> None:
            while queue:
                item = queue.pop()
                if item.after is not None:
                    await done[item.after].wait()
                out.append(await send_one(session, base_url, item, hdrs))
                done[item.request_id].set()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return out, wall


async def engine_counters(urls: Sequence[str]) -> dict[str, EngineMetrics]:
    """Each engine's metrics (KV hits/queries, finished requests), read from ``/metrics``."""

    async def one(url: str) -> EngineMetrics:
        async with EngineClient(url) as c:
            return await c.metrics()

    ms = await asyncio.gather(*(one(u) for u in urls))
    return dict(zip(urls, ms, strict=True))


async def reset_caches(urls: Sequence[str]) -> None:
    """Empty every engine's prefix cache (``POST /reset_prefix_cache``) before a run."""
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.post(u + "/reset_prefix_cache") as resp:
                await resp.read()


def _finished(m: EngineMetrics) -> float:
    return sum(v for k, v in m.samples.items() if k.startswith("vllm:request_success"))


def summarize(
    outcomes: Sequence[Outcome],
    wall_s: float,
    before: Mapping[str, EngineMetrics],
    after: Mapping[str, EngineMetrics],
) -> dict[str, Any]:
    """Hit rate and shares from the engines' counters; TTFT and throughput from the client."""
    hits = sum(after[u].prefix_cache_hits - before[u].prefix_cache_hits for u in after)
    queries = sum(after[u].prefix_cache_queries - before[u].prefix_cache_queries for u in after)
    per = {u: _finished(after[u]) - _finished(before[u]) for u in after}
    total = sum(per.values()) or 1.0
    shares = {u: per[u] / total for u in per}
    mean = 1.0 / len(per) if per else 0.0
    ok = [o for o in outcomes if o.status == 200]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "shares": shares,
        "max_share_ratio": (max(shares.values()) / mean) if shares and mean else 0.0,
    }


def prompt_tokens(item: WorkItem, tokenizer: Tokenizer | None = None) -> list[int]:
    """The token ids the simulated engine computes for a request (same template)."""
    tok = tokenizer or Tokenizer()
    if item.path == CHAT:
        return tok.encode(render_chat(item.body["messages"], item.body.get("tools")))
    prompt = item.body["prompt"]
    return tok.encode(prompt if isinstance(prompt, str) else prompt[0])


def oracle_hit_rate(items: Sequence[WorkItem], block_size: int = 16) -> float:
    """Hit rate of one unbounded cache that sees every request (an upper bound)."""
    tok = Tokenizer()
    seen: set[int] = set()
    hits = 0
    queries = 0
    for item in items:
        tokens = prompt_tokens(item, tok)
        hashes = block_hashes(tokens, block_size)
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        hits += min(matched * block_size, max(len(tokens) - 1, 0))
        queries += len(tokens)
        seen.update(hashes)
    return hits / queries if queries else 0.0
