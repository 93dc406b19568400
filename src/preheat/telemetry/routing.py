"""Routing decisions as frozen records, written as sampled JSONL (never prompt text).

One line per sampled request, with these keys (the report reads them):
``ts`` (epoch seconds), ``request_id``, ``variant``, ``strategy``, ``instance`` (URL),
``rank`` (preferred candidates passed over for load; 0 = first choice), ``outcome``
(affinity | spill | fallback | random | least_outstanding | hint), ``matched_blocks``,
``prefix_blocks``, ``predicted_cached_tokens``, ``actual_cached_tokens`` (the engine's
``usage.prompt_tokens_details.cached_tokens`` when it reports it, else null),
``prompt_tokens`` (the engine's ``usage.prompt_tokens``, else null) and ``decision_us``.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from preheat.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One routing decision and what the engine reported back."""

    ts: float
    request_id: str
    variant: str
    strategy: str
    instance: str
    rank: int
    outcome: str
    matched_blocks: int
    prefix_blocks: int
    predicted_cached_tokens: int | None
    actual_cached_tokens: int | None
    prompt_tokens: int | None
    decision_us: float

    def to_dict(self) -> dict[str, Any]:
        """The record as a plain dict (built field by field: ``asdict`` deep-copies)."""
        return {
            "ts": self.ts,
            "request_id": self.request_id,
            "variant": self.variant,
            "strategy": self.strategy,
            "instance": self.instance,
            "rank": self.rank,
            "outcome": self.outcome,
            "matched_blocks": self.matched_blocks,
            "prefix_blocks": self.prefix_blocks,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "actual_cached_tokens": self.actual_cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "decision_us": self.decision_us,
        }

    def to_json_bytes(self) -> bytes:
        """One compact JSON line without the newline (orjson: ~1 us)."""
        return orjson.dumps(self.to_dict())

    def to_json(self) -> str:
        return self.to_json_bytes().decode()


def read_decisions(path: str | Path) -> list[RouteDecision]:
    """Load a decision log written by ``DecisionLog``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                data: dict[str, Any] = json.loads(line)
                out.append(RouteDecision(**data))
    return out


class DecisionLog:
    """Append sampled decisions to a JSONL file; ``sample`` in [0, 1] is the kept share.

    Each line is one ``write(2)`` on an ``O_APPEND`` descriptor: no Python buffer to
    flush, so a reader sees every finished request's line at once, and lines from
    several routers appending to one file never interleave mid-line.
    """

    def __init__(self, path: str | Path, sample: float = 1.0, *, rng: random.Random) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ConfigError(f"decision sample rate {sample} is outside 0-1; e.g. 0.01 keeps 1%")
        self.path = Path(path)
        self.sample = sample
        self._rng = rng
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def sampled(self) -> bool:
        """Whether the next request should be logged (decided before it is proxied)."""
        return self.sample >= 1.0 or (self.sample > 0.0 and self._rng.random() < self.sample)

    def write(self, decision: RouteDecision) -> None:
        if self._fd is not None:
            os.write(self._fd, orjson.dumps(decision.to_dict(), option=orjson.OPT_APPEND_NEWLINE))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
