"""Helpers to run a local fleet in tests, benchmarks and the demo.

::

    model = make_model(tmp_path / "origin" / "m1", size=4_000_000, shards=4, seed=1)
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a", "b", "c"], bandwidth="4MB/s")
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        result = await run_load(fleet.router.url, requests=50, concurrency=4)

``run_load`` is bounded in count and time, and reports every status it saw.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from preheat.artifacts.refs import MANIFEST_NAME
from preheat.bench.models import generate_model, rewrite_shard, write_http_manifest
from preheat.control.spec import ClusterSpec, EndpointSpec, parse_cluster, parse_endpoint
from preheat.telemetry.events import StartRecord, read_start_records

__all__ = [
    "LoadResult",
    "SampleModel",
    "cluster_spec",
    "endpoint_spec",
    "make_model",
    "make_new_revision",
    "run_load",
    "start_records",
]


@dataclass(frozen=True)
class SampleModel:
    dir: Path
    size: int
    shards: int

    @property
    def ref(self) -> str:
        return f"file://{self.dir.resolve()}"

    def http_ref(self, base_url: str, root: Path) -> str:
        """The manifest URL of this model on an HTTP origin serving ``root``."""
        rel = self.dir.resolve().relative_to(root.resolve()).as_posix()
        return f"{base_url}/{rel}/{MANIFEST_NAME}"


def _size(dir: Path) -> int:
    return sum(p.stat().st_size for p in dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def make_model(dir: Path, *, size: int = 4_000_000, shards: int = 4, seed: int = 1) -> SampleModel:
    """A safetensors-style sample model of ``size`` bytes in ``shards`` shards, with the
    ``preheat-manifest.json`` (sha256 per file) an HTTP origin serves."""
    generate_model(dir, size, shards, seed=seed)
    write_http_manifest(dir)
    return SampleModel(dir, _size(dir), shards)


def make_new_revision(
    model: SampleModel, dest: Path, *, shard: int = 0, seed: int = 99
) -> SampleModel:
    """A copy of ``model`` at ``dest`` with one shard rewritten: a one-shard version change."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in model.dir.iterdir():
        if p.is_file():
            (dest / p.name).write_bytes(p.read_bytes())
    (dest / MANIFEST_NAME).unlink(missing_ok=True)
    rewrite_shard(dest, shard, seed)
    write_http_manifest(dest)
    return SampleModel(dest, _size(dest), model.shards)


def endpoint_spec(
    name: str,
    source: str,
    *,
    replicas: int = 1,
    max_replicas: int | None = None,
    cache: dict[str, Any] | None = None,
    strategy: str = "random",
    time_scale: float = 0.01,
    profile: str = "tiny",
    **extra: Any,
) -> EndpointSpec:
    """An endpoint spec with the simulated engine (validated like a YAML file)."""
    doc: dict[str, Any] = {
        "name": name,
        "model": {"source": source},
        "engine": {"simulated": {"profile": profile, "time_scale": time_scale}},
        "replicas": {"min": replicas, "max": max_replicas or max(replicas, 4)},
        "routing": {"strategy": strategy},
        **extra,
    }
    if cache is not None:
        doc["modelCacheConfig"] = {"weights": cache}
    return parse_endpoint(doc)


def cluster_spec(
    base: Path,
    names: list[str],
    *,
    bandwidth: str | None = None,
    capacity: str = "1GiB",
    slots: int = 2,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> ClusterSpec:
    """A cluster of ``names`` with stores under ``base/nodes``; per-node overrides."""
    nodes = []
    for n in names:
        node: dict[str, Any] = {"name": n, "capacity": capacity, "slots": slots}
        node.update((overrides or {}).get(n, {}))
        nodes.append(node)
    doc: dict[str, Any] = {"nodes": nodes}
    if bandwidth:
        doc["origin"] = {"bandwidth": bandwidth}
    return parse_cluster(doc, base_dir=base)


@dataclass
class LoadResult:
    statuses: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> int:
        return sum(1 for s in self.statuses if s == 200)

    @property
    def failed(self) -> int:
        return len(self.statuses) - self.ok + len(self.errors)


async def run_load(
    url: str,
    *,
    requests: int,
    concurrency: int = 4,
    timeout: float = 60.0,
    model: str | None = None,
    prompts: list[str] | None = None,
    max_tokens: int = 8,
    seed: int = 0,
    stream: bool = True,
    stop: asyncio.Event | None = None,
) -> LoadResult:
    """Send at most ``requests`` completions through ``url`` (bounded by ``timeout`` s);
    records HTTP statuses, transport errors and time to first streamed byte."""
    rng = random.Random(seed)
    result = LoadResult()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    t0 = time.monotonic()
    deadline = t0 + timeout

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            prompt = prompts[rng.randrange(len(prompts))] if prompts else f"request {i}"
            body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
            if model:
                body["model"] = model
            sent = time.monotonic()
            try:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    first = None
                    data = bytearray()
                    async for chunk in resp.content.iter_any():
                        if first is None and chunk:
                            first = time.monotonic()
                        data += chunk
                    result.statuses.append(resp.status)
                    if resp.status != 200:
                        continue
                    if stream and (b"event: error" in data or b"[DONE]" not in data):
                        result.errors.append(f"broken stream: {bytes(data[-200:])!r}")
                    elif first is not None:
                        result.ttft.append(first - sent)
            except (aiohttp.ClientError, TimeoutError) as exc:
                result.errors.append(f"{type(exc).__name__}: {exc}")

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=max(1.0, timeout))
    ) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    result.seconds = time.monotonic() - t0
    return result


def start_records(path: Path) -> list[StartRecord]:
    """Every start record in a fleet's ``events.jsonl``."""
    if not path.exists():
        return []
    return read_start_records(path)
