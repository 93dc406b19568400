"""Percentiles of start times per event class and stage (pure: no I/O, no clock).

Never one blended mean: a warm restart and a first start on a new node differ by orders of
magnitude, and averaging them describes no start that happened. Every figure here is a
percentile within one event class, for one stage (the time between two consecutive
recorded boundaries, see ``StartRecord.stage_durations``) or for readiness as a whole
(``ready``: scheduled -> healthy).

Percentiles use linear interpolation between order statistics (the default of numpy's
``percentile`` and of Prometheus' ``histogram_quantile`` within a bucket), so p99 of a
small sample lies between its two largest values instead of jumping to the maximum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from preheat.telemetry.records import STAGES, WEIGHTS_SOURCES, EventClass, StartRecord

__all__ = [
    "READY",
    "ClassSummary",
    "Percentiles",
    "StageStats",
    "percentile",
    "stage_table",
    "summarize_classes",
]

#: Name of the whole-readiness row (scheduled -> healthy) next to the stages.
READY = "ready"
QUANTILES: tuple[float, ...] = (50.0, 95.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values`` by linear interpolation."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q = {q} is outside 0..100")
    if not values:
        raise ValueError("percentile of no values; check the sample is not empty first")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(xs[lo])
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50/p95/p99 (and the range) of one sample."""

    n: int
    p50: float
    p95: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(
            n=len(values),
            p50=percentile(values, 50),
            p95=percentile(values, 95),
            p99=percentile(values, 99),
            min=float(min(values)),
            max=float(max(values)),
        )


@dataclass(frozen=True, slots=True)
class StageStats:
    """Percentiles of one stage (or ``ready``) within one event class."""

    event_class: EventClass
    stage: str
    seconds: Percentiles


@dataclass(frozen=True, slots=True)
class ClassSummary:
    """Counts and cache outcome of the starts of one event class."""

    event_class: EventClass
    starts: int
    failures: int
    weights_hits: int
    weights_misses: int
    image_hits: int
    image_misses: int
    bytes_from: dict[str, int] = field(default_factory=dict)
    ready: Percentiles | None = None

    @property
    def hit_ratio(self) -> float | None:
        total = self.weights_hits + self.weights_misses
        return None if total == 0 else self.weights_hits / total


def _class_order(classes: Iterable[EventClass]) -> list[EventClass]:
    order = list(EventClass)
    return sorted(set(classes), key=order.index)


def stage_table(records: Iterable[StartRecord]) -> list[StageStats]:
    """One row per (event class, stage) that has data, stages in start order, then ``ready``.

    Failed starts contribute the stages they completed, never a ``ready`` time.
    """
    samples: dict[tuple[EventClass, str], list[float]] = {}
    for r in records:
        for stage, seconds in r.stage_durations().items():
            samples.setdefault((r.event_class, stage), []).append(seconds)
        if r.ok and r.ready_seconds is not None:
            samples.setdefault((r.event_class, READY), []).append(r.ready_seconds)
    stage_order = [*STAGES, READY]
    rows = []
    for cls in _class_order(c for c, _ in samples):
        for stage in stage_order:
            values = samples.get((cls, stage))
            if values:
                rows.append(StageStats(cls, stage, Percentiles.of(values)))
    return rows


def summarize_classes(records: Iterable[StartRecord]) -> list[ClassSummary]:
    """Per event class: starts, failures, cache hits/misses, bytes by source, readiness."""
    groups: dict[EventClass, list[StartRecord]] = {}
    for r in records:
        groups.setdefault(r.event_class, []).append(r)
    out = []
    for cls in _class_order(groups):
        rs = groups[cls]
        bytes_from = dict.fromkeys(WEIGHTS_SOURCES, 0)
        for r in rs:
            for source, n in r.bytes_from.items():
                bytes_from[source] += n
        ready = [r.ready_seconds for r in rs if r.ok and r.ready_seconds is not None]
        out.append(
            ClassSummary(
                event_class=cls,
                starts=len(rs),
                failures=sum(1 for r in rs if not r.ok),
                weights_hits=sum(1 for r in rs if r.weights_source == "cache"),
                weights_misses=sum(1 for r in rs if r.weights_source != "cache"),
                image_hits=sum(1 for r in rs if r.image_source == "cache"),
                image_misses=sum(1 for r in rs if r.image_source == "pull"),
                bytes_from=bytes_from,
                ready=Percentiles.of(ready) if ready else None,
            )
        )
    return out
