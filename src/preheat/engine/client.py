"""An async client for OpenAI-compatible engines: requests, metrics and start stages.

Works against the simulated engine, vLLM, SGLang and llama.cpp's ``llama-server``:

* :class:`EngineClient` sends ``/v1/completions`` and ``/v1/chat/completions`` requests
  (streaming or not) and measures TTFT, inter-token gaps and end-to-end time on the
  client side; it reads ``usage.prompt_tokens_details.cached_tokens`` when the engine
  reports it (vLLM with ``--enable-prompt-tokens-details``, llama.cpp, preheat).
* :func:`parse_metrics` / :meth:`EngineClient.metrics` read Prometheus text and map both
  vLLM names (``vllm:prefix_cache_queries_total`` ...) and llama.cpp names
  (``llamacpp:prompt_tokens_total`` counts only *uncached* prompt tokens, and
  ``llamacpp:prompt_tokens_cached_total`` the reused ones) onto one :class:`EngineMetrics`.
* :meth:`EngineClient.probe_start` returns the start stages: from ``GET /startup`` where
  the engine has it (preheat), otherwise observed from outside: the first HTTP answer
  (``runtime_started``) and the first ``/health`` 200 (``weights_loaded`` = ``healthy``).
  llama-server answers ``/health`` with 503 "Loading model" while it loads.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from preheat.errors import EngineError, EngineUnavailable

__all__ = [
    "Completion",
    "EngineClient",
    "EngineMetrics",
    "StartStages",
    "parse_metrics",
    "parse_prometheus",
]


@dataclass(frozen=True)
class Completion:
    """One finished request as the client saw it."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    """``usage.prompt_tokens_details.cached_tokens``; None if the engine does not say."""
    finish_reason: str | None
    ttft_s: float
    """Send to first content (streaming) or to the full response (non-streaming)."""
    e2e_s: float
    itl_s: tuple[float, ...] = ()
    """Gaps between successive content chunks (streaming only)."""
    raw_usage: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineMetrics:
    """The few engine figures routers and benchmarks read, whatever the engine's names."""

    flavour: str
    """``vllm`` (also preheat's engine), ``llamacpp`` or ``unknown``."""
    prefix_cache_queries: float
    """Prompt tokens looked up (llama.cpp: processed + cached prompt tokens)."""
    prefix_cache_hits: float
    """Prompt tokens served from the cache."""
    requests_running: float
    requests_waiting: float
    kv_cache_usage: float | None
    """0..1, where the engine reports it."""
    prompt_tokens: float
    generation_tokens: float
    ttft_count: float = 0.0
    ttft_sum: float = 0.0
    samples: Mapping[str, float] = field(default_factory=dict)
    """Every sample, label sets summed per sample name."""

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass(frozen=True)
class StartStages:
    """Start-stage timestamps (epoch seconds) of one engine process."""

    runtime_started: float | None
    weights_loaded: float | None
    healthy: float | None
    source: str
    """``startup`` (the engine reported them) or ``observed`` (probed from outside)."""
    weights_bytes: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(v):
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def parse_metrics(text: str) -> EngineMetrics:
    """Map vLLM / preheat or llama.cpp metric names onto :class:`EngineMetrics`."""
    s = parse_prometheus(text)
    if any(k.startswith("vllm:") for k in s):
        queries = s.get(
            "vllm:prefix_cache_queries_total", s.get("vllm:gpu_prefix_cache_queries_total", 0.0)
        )
        hits = s.get("vllm:prefix_cache_hits_total", s.get("vllm:gpu_prefix_cache_hits_total", 0.0))
        usage = s.get("vllm:kv_cache_usage_perc", s.get("vllm:gpu_cache_usage_perc"))
        return EngineMetrics(
            flavour="vllm",
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            requests_running=s.get("vllm:num_requests_running", 0.0),
            requests_waiting=s.get("vllm:num_requests_waiting", 0.0),
            kv_cache_usage=usage,
            prompt_tokens=s.get("vllm:prompt_tokens_total", 0.0),
            generation_tokens=s.get("vllm:generation_tokens_total", 0.0),
            ttft_count=s.get("vllm:time_to_first_token_seconds_count", 0.0),
            ttft_sum=s.get("vllm:time_to_first_token_seconds_sum", 0.0),
            samples=s,
        )
    if any(k.startswith("llamacpp:") for k in s):
        computed = s.get("llamacpp:prompt_tokens_total", 0.0)
        cached = s.get("llamacpp:prompt_tokens_cached_total", 0.0)
        return EngineMetrics(
            flavour="llamacpp",
            prefix_cache_queries=computed + cached,
            prefix_cache_hits=cached,
            requests_running=s.get("llamacpp:requests_processing", 0.0),
            requests_waiting=s.get("llamacpp:requests_deferred", 0.0),
            kv_cache_usage=s.get("llamacpp:kv_cache_usage_ratio"),
            prompt_tokens=computed + cached,
            generation_tokens=s.get("llamacpp:tokens_predicted_total", 0.0),
            samples=s,
        )
    return EngineMetrics("unknown", 0.0, 0.0, 0.0, 0.0, None, 0.0, 0.0, samples=s)


class EngineClient:
    """Async client of one engine at ``base_url`` (``http://127.0.0.1:8001``)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    # --- requests -----------------------------------------------------------------------

    async def completion(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 16,
        stream: bool = False,
        **extra: Any,
    ) -> Completion:
        body: dict[str, Any] = {"prompt": prompt if isinstance(prompt, str) else list(prompt)}
        return await self._generate("/v1/completions", body, max_tokens, stream, extra, chat=False)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int = 16,
        stream: bool = False,
        **extra: Any,
    ) -> Completion:
        body: dict[str, Any] = {"messages": list(messages)}
        return await self._generate(
            "/v1/chat/completions", body, max_tokens, stream, extra, chat=True
        )

    async def _generate(
        self,
        path: str,
        body: dict[str, Any],
        max_tokens: int,
        stream: bool,
        extra: Mapping[str, Any],
        *,
        chat: bool,
    ) -> Completion:
        body["max_tokens"] = max_tokens
        body["stream"] = stream
        if self.model is not None:
            body.setdefault("model", self.model)
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(extra)
        t0 = time.perf_counter()
        try:
            async with self.session.post(self.base_url + path, json=body) as resp:
                if resp.status != 200:
                    raise EngineError(
                        f"{self.base_url}{path} answered {resp.status}: {(await resp.text())[:500]}"
                    )
                if not stream:
                    data = await resp.json(content_type=None)
                    t1 = time.perf_counter()
                    choice = data["choices"][0]
                    text = choice["message"]["content"] if chat else choice["text"]
                    return _completion(
                        text or "",
                        data.get("usage") or {},
                        choice.get("finish_reason"),
                        t1 - t0,
                        t1 - t0,
                        (),
                    )
                return await _read_stream(resp, t0, chat)
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {exc}") from exc

    # --- state --------------------------------------------------------------------------

    async def models(self) -> list[str]:
        data = await self._get_json("/v1/models")
        return [m["id"] for m in data.get("data", [])]

    async def health(self) -> bool:
        """True on ``/health`` 200; False on any other answer or no answer."""
        try:
            async with self.session.get(self.base_url + "/health") as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, OSError):
            return False

    async def metrics(self) -> EngineMetrics:
        try:
            async with self.session.get(self.base_url + "/metrics") as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineError(
                        f"{self.base_url}/metrics answered {resp.status}: {text[:200]} "
                        "(llama-server needs --metrics)"
                    )
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self.base_url}/metrics: {exc}") from exc
        return parse_metrics(text)

    async def wait_healthy(self, timeout_s: float = 60.0, interval_s: float = 0.05) -> float:
        """Poll ``/health`` until 200; returns the epoch time it was first seen healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.health():
                return time.time()
            await asyncio.sleep(interval_s)
        raise EngineUnavailable(f"{self.base_url} was not healthy within {timeout_s:.0f} s")

    async def probe_start(
        self,
        *,
        spawned_at: float | None = None,
        timeout_s: float = 60.0,
        interval_s: float = 0.02,
    ) -> StartStages:
        """The engine's start stages; see the module docstring for the two sources.

        Call it right after starting the process (``spawned_at`` = epoch time of the
        spawn, used as ``runtime_started`` by the observed path when given).
        """
        deadline = time.monotonic() + timeout_s
        first_answer: float | None = None
        while time.monotonic() < deadline:
            try:
                async with self.session.get(self.base_url + "/startup") as resp:
                    now = time.time()
                    first_answer = first_answer or now
                    if resp.status == 200:
                        data = await resp.json(content_type=None)
                        stages = data.get("stages") if isinstance(data, dict) else None
                        if isinstance(stages, dict):
                            if stages.get("healthy") is None:
                                await asyncio.sleep(interval_s)
                                continue
                            return StartStages(
                                runtime_started=stages.get("runtime_started"),
                                weights_loaded=stages.get("weights_loaded"),
                                healthy=stages.get("healthy"),
                                source="startup",
                                weights_bytes=data.get("weights_bytes"),
                                extra=data,
                            )
                    else:
                        await resp.read()
                # No /startup: observe /health.
                if await self.health():
                    healthy = time.time()
                    return StartStages(
                        runtime_started=spawned_at if spawned_at is not None else first_answer,
                        weights_loaded=healthy,
                        healthy=healthy,
                        source="observed",
                    )
            except (aiohttp.ClientError, OSError):
                pass  # not listening yet
            await asyncio.sleep(interval_s)
        raise EngineUnavailable(f"{self.base_url} did not finish starting within {timeout_s:.0f} s")

    async def _get_json(self, path: str) -> Any:
        try:
            async with self.session.get(self.base_url + path) as resp:
                if resp.status != 200:
                    raise EngineError(
                        f"{self.base_url}{path} answered {resp.status}: {(await resp.text())[:300]}"
                    )
                return await resp.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {exc}") from exc


def _completion(
    text: str,
    usage: Mapping[str, Any],
    finish_reason: str | None,
    ttft: float,
    e2e: float,
    itl: tuple[float, ...],
) -> Completion:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return Completion(
        text=text,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int(cached) if cached is not None else None,
        finish_reason=finish_reason,
        ttft_s=ttft,
        e2e_s=e2e,
        itl_s=itl,
        raw_usage=dict(usage),
    )


async def _read_stream(resp: aiohttp.ClientResponse, t0: float, chat: bool) -> Completion:
    parts: list[str] = []
    times: list[float] = []
    usage: Mapping[str, Any] = {}
    finish: str | None = None
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                data = json.loads(payload)
                if data.get("usage"):
                    usage = data["usage"]
                for choice in data.get("choices") or []:
                    piece = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    if piece:
                        parts.append(piece)
                        times.append(time.perf_counter())
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    t_end = time.perf_counter()
    ttft = (times[0] - t0) if times else t_end - t0
    itl = tuple(b - a for a, b in itertools.pairwise(times))
    return _completion("".join(parts), usage, finish, ttft, t_end - t0, itl)
