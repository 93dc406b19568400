"""Reproducible synthetic start records and routing decisions for tests and benchmarks.

The shapes follow the fleet: warm starts spend most of their time loading weights into
the engine; cold starts (``new_node`` on an unwarmed node) spend it fetching from the
origin. Seeded, so a test can recompute any figure it asserts from the same records.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from preheat.telemetry.events import EventClass, StartRecord

__all__ = ["synthetic_route_decisions", "synthetic_starts"]

_MODEL_BYTES = 2 * 1024**3


def synthetic_starts(
    n: int, *, seed: int = 0, t0: float = 1_700_000_000.0, failures: int = 0
) -> list[StartRecord]:
    """``n`` starts cycling through every event class; the last ``failures`` never get healthy."""
    rng = random.Random(seed)
    classes = list(EventClass)
    out = []
    t = t0
    for i in range(n):
        cls = classes[i % len(classes)]
        cold = cls is EventClass.NEW_NODE
        t += rng.uniform(1.0, 5.0)
        scheduled = t
        image_ready = scheduled + rng.uniform(0.01, 0.2)
        fetch = rng.uniform(20.0, 40.0) if cold else rng.uniform(0.01, 0.1)
        weights_ready = image_ready + fetch
        runtime_started = weights_ready + rng.uniform(0.05, 0.15)
        weights_loaded = runtime_started + rng.uniform(1.0, 3.0)
        healthy = weights_loaded + rng.uniform(0.1, 0.5)
        first_response = healthy + rng.uniform(0.02, 0.1)
        failed = i >= n - failures
        out.append(
            StartRecord(
                endpoint="chat",
                variant="main",
                replica=f"chat-main-{i}",
                node=f"node-{i % 4}",
                revision="rev-1" if cls is not EventClass.NEW_VERSION else "rev-2",
                event_class=cls,
                scheduled=scheduled,
                image_ready=image_ready,
                weights_ready=weights_ready,
                runtime_started=runtime_started,
                weights_loaded=None if failed else weights_loaded,
                healthy=None if failed else healthy,
                first_response=None if failed else first_response,
                image_source="pull" if cold else "cache",
                weights_source="origin" if cold else "cache",
                bytes_from={"origin": _MODEL_BYTES} if cold else {"cache": _MODEL_BYTES},
                failure="engine exited with code 1 while loading" if failed else None,
            )
        )
    return out


def synthetic_route_decisions(
    path: Path, n: int, *, seed: int = 0, t0: float = 1_700_000_000.0, instances: int = 4
) -> list[dict[str, object]]:
    """Write ``n`` decision lines (half ``random``, half ``prefix_aware``) and return them."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for i in range(n):
        strategy = "random" if i < n // 2 else "prefix_aware"
        prompt = rng.randint(256, 4096)
        block = 16
        prefix_blocks = prompt // block
        if strategy == "prefix_aware":
            matched = rng.randint(0, prefix_blocks)
            actual = max(0, min(prompt, matched * block - block * rng.randint(0, 2)))
        else:
            matched = 0
            actual = block * rng.randint(0, prefix_blocks // 4)
        rows.append(
            {
                "ts": t0 + i * 0.05,
                "request_id": f"req-{i}",
                "variant": "main",
                "strategy": strategy,
                "instance": f"inst-{rng.randrange(instances)}",
                "rank": 0,
                "outcome": "ok",
                "matched_blocks": matched,
                "prefix_blocks": prefix_blocks,
                "predicted_cached_tokens": matched * block,
                "actual_cached_tokens": actual,
                "prompt_tokens": prompt,
                "decision_us": rng.uniform(2.0, 30.0),
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows
