"""Routing decisions as frozen records, written as sampled JSONL (never prompt text).

One line per sampled request, with these keys (the report reads them):
``ts`` (epoch seconds), ``request_id``, ``variant``, ``strategy``, ``instance`` (URL),
``rank`` (preferred candidates passed over for load; 0 = first choice), ``outcome``
(affinity | spill | fallback | random | least_outstanding | hint), ``matched_blocks``,
``prefix_blocks``, ``predicted_cached_tokens``, ``actual_cached_tokens`` (the engine's
``usage.prompt_tokens_details.cached_tokens`` when it reports it, else null),
``prompt_tokens`` (the engine's ``usage.prompt_tokens``, else null) and ``decision_us``.

``read_decisions`` is the one reader of that file (the report uses it too): torn lines
from a killed writer are skipped, a line that is JSON but not a decision is an error
naming the file and line. ``routing_stats`` summarises decisions per strategy.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from preheat.errors import ConfigError
from preheat.telemetry.events import read_jsonl
from preheat.telemetry.stats import percentile

__all__ = [
    "DecisionLog",
    "RouteDecision",
    "RoutingStats",
    "read_decisions",
    "routing_stats",
]

#: Keys a decision line must have; the others default (older logs did not write them).
REQUIRED_KEYS = ("ts", "variant", "strategy", "instance", "outcome", "decision_us")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RouteDecision:
        """A decision from one decoded line; ``ValueError`` names missing keys."""
        missing = [k for k in REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"route decision is missing keys {missing}")
        if d["instance"] is None:
            raise ValueError("route decision has instance null; a decision names its instance")
        return cls(
            ts=float(d["ts"]),
            request_id=str(d.get("request_id", "")),
            variant=str(d["variant"]),
            strategy=str(d["strategy"]),
            instance=str(d["instance"]),
            rank=int(d.get("rank", 0)),
            outcome=str(d["outcome"]),
            matched_blocks=int(d.get("matched_blocks", 0)),
            prefix_blocks=int(d.get("prefix_blocks", 0)),
            predicted_cached_tokens=_opt_int(d.get("predicted_cached_tokens")),
            actual_cached_tokens=_opt_int(d.get("actual_cached_tokens")),
            prompt_tokens=_opt_int(d.get("prompt_tokens")),
            decision_us=float(d["decision_us"]),
        )


def read_decisions(path: str | os.PathLike[str]) -> list[RouteDecision]:
    """The decisions in a log written by ``DecisionLog`` (torn lines skipped)."""
    return read_jsonl(path, RouteDecision.from_dict).records


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """Per strategy: decisions, instance shares, predicted and actual KV hit rates."""

    strategy: str
    decisions: int
    shares: dict[str, float]
    kv_hit_rate: float | None
    predicted_hit_rate: float | None
    #: Mean |predicted - actual| cached tokens over requests whose engine reported usage.
    mean_abs_error_tokens: float | None
    decision_us_p50: float
    decision_us_p99: float


def routing_stats(rows: Sequence[RouteDecision]) -> list[RoutingStats]:
    """One summary per strategy, strategies in name order.

    Hit rates count only requests whose engine reported usage; a decision without a
    prediction (``random``) predicts 0 cached tokens.
    """
    groups: dict[str, list[RouteDecision]] = {}
    for r in rows:
        groups.setdefault(r.strategy, []).append(r)
    out = []
    for strategy in sorted(groups):
        rs = groups[strategy]
        counts: dict[str, int] = {}
        for r in rs:
            counts[r.instance] = counts.get(r.instance, 0) + 1
        routed = sum(counts.values())
        shares = {k: v / routed for k, v in sorted(counts.items())} if routed else {}
        reported = [r for r in rs if r.actual_cached_tokens is not None and r.prompt_tokens]
        prompt = sum(r.prompt_tokens or 0 for r in reported)
        actual = sum(r.actual_cached_tokens or 0 for r in reported)
        predicted = sum(r.predicted_cached_tokens or 0 for r in reported)
        err = [
            abs((r.predicted_cached_tokens or 0) - (r.actual_cached_tokens or 0)) for r in reported
        ]
        us = [r.decision_us for r in rs]
        out.append(
            RoutingStats(
                strategy=strategy,
                decisions=len(rs),
                shares=shares,
                kv_hit_rate=actual / prompt if prompt else None,
                predicted_hit_rate=predicted / prompt if prompt else None,
                mean_abs_error_tokens=sum(err) / len(err) if err else None,
                decision_us_p50=percentile(us, 50),
                decision_us_p99=percentile(us, 99),
            )
        )
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
