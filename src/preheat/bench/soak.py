"""Soak benchmark figures: per-window latency and memory, and their trend.

The soak (``benchmarks/soak.py``) sends mixed traffic at a fixed rate for a bounded
time and, once per window (a minute), records what finished in it and each process's
resident memory. Here is what turns those samples into the table and the verdict:
``window_stats`` (percentiles via ``telemetry.stats.percentile``), ``slope`` (least
squares, per minute) and ``trend`` (RSS slope of the router and of the engines, first
vs last window p99).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from preheat.telemetry.stats import percentile

__all__ = ["Trend", "Window", "rss_bytes", "slope", "trend", "window_stats"]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` from ``/proc/PID/status`` (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True, slots=True)
class Window:
    """One sampling window: what finished in it, and memory at its end."""

    minute: float
    """Minutes since the start, at the end of the window."""
    sent: int
    ok: int
    errors: int
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    ttft_p99_s: float | None
    router_rss: int | None
    engines_rss: int | None
    """Sum over the engines (None if any engine is gone)."""
    late: int = 0
    """Requests sent more than a second behind their schedule (the client fell behind)."""


def window_stats(
    minute: float,
    *,
    sent: int,
    statuses: Sequence[int],
    e2e_s: Sequence[float],
    ttft_s: Sequence[float],
    router_rss: int | None,
    engine_rss: Sequence[int | None],
    late: int = 0,
) -> Window:
    """A ``Window`` from the requests that finished in it (``e2e_s``/``ttft_s`` of the
    successful ones) and the memory read at its end."""
    ok = sum(1 for s in statuses if s == 200)
    known = [r for r in engine_rss if r is not None]
    return Window(
        minute=minute,
        sent=sent,
        ok=ok,
        errors=len(statuses) - ok,
        e2e_p50_s=percentile(e2e_s, 50) if e2e_s else None,
        e2e_p99_s=percentile(e2e_s, 99) if e2e_s else None,
        ttft_p99_s=percentile(ttft_s, 99) if ttft_s else None,
        router_rss=router_rss,
        engines_rss=sum(known) if len(known) == len(engine_rss) else None,
        late=late,
    )


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``xs`` (None with fewer than two points)."""
    if len(xs) != len(ys):
        raise ValueError(f"slope needs as many x as y values; got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        return None
    mx = sum(xs) / len(xs)
    my = sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


@dataclass(frozen=True, slots=True)
class Trend:
    """Memory growth per minute and the latency drift over a soak."""

    router_rss_per_min: float | None
    engines_rss_per_min: float | None
    first_p99_s: float | None
    last_p99_s: float | None

    @property
    def p99_ratio(self) -> float | None:
        """Last window's p99 over the first's."""
        if not self.first_p99_s or self.last_p99_s is None:
            return None
        return self.last_p99_s / self.first_p99_s


def trend(windows: Sequence[Window], *, skip_first: bool = True) -> Trend:
    """Slopes of RSS (bytes per minute) and first vs last p99. The first window (start-up
    allocations, caches filling) is left out of the slopes when there are at least three."""
    fit = list(windows[1:] if skip_first and len(windows) >= 3 else windows)

    def fitted(attr: str) -> float | None:
        pts = [(w.minute, getattr(w, attr)) for w in fit if getattr(w, attr) is not None]
        return slope([p[0] for p in pts], [float(p[1]) for p in pts])

    p99s = [w.e2e_p99_s for w in windows if w.e2e_p99_s is not None]
    return Trend(
        router_rss_per_min=fitted("router_rss"),
        engines_rss_per_min=fitted("engines_rss"),
        first_p99_s=p99s[0] if p99s else None,
        last_p99_s=p99s[-1] if p99s else None,
    )
