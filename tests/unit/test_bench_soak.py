"""Soak figures: per-window percentiles, RSS slope per minute, first vs last p99."""

from __future__ import annotations

import os

import pytest

from preheat.bench.soak import rss_bytes, slope, trend, window_stats
from preheat.telemetry.stats import percentile

MIB = 1024 * 1024


def _window(minute: float, router_mib: float, p99: float) -> object:
    return window_stats(
        minute,
        sent=10,
        statuses=[200] * 9 + [502],
        e2e_s=[0.01] * 8 + [p99, p99],
        ttft_s=[0.005] * 9,
        router_rss=int(router_mib * MIB),
        engine_rss=[100 * MIB, 100 * MIB],
    )


def test_window_counts_and_interpolated_percentiles() -> None:
    """A window counts errors and takes its percentiles from the one percentile function."""
    e2e = [0.01 * i for i in range(1, 101)]
    w = window_stats(
        1.0,
        sent=102,
        statuses=[200] * 100 + [503, 0],
        e2e_s=e2e,
        ttft_s=e2e[:50],
        router_rss=5,
        engine_rss=[1, 2, None],
    )
    assert (w.sent, w.ok, w.errors) == (102, 100, 2)
    assert w.e2e_p99_s == pytest.approx(percentile(e2e, 99))
    assert w.e2e_p50_s == pytest.approx(0.505)
    assert w.engines_rss is None  # an engine is gone: no sum that hides it
    empty = window_stats(
        2.0, sent=0, statuses=[], e2e_s=[], ttft_s=[], router_rss=None, engine_rss=[]
    )
    assert empty.e2e_p99_s is None and empty.engines_rss == 0


def test_trend_reports_growth_per_minute_without_the_start_up_window() -> None:
    """A router growing 2 MiB a minute after a large first window shows a 2 MiB/min slope."""
    windows = [_window(1, 80, 0.05)] + [
        _window(m, 40 + 2 * m, 0.05 + 0.01 * m) for m in range(2, 7)
    ]
    t = trend(windows)  # type: ignore[arg-type]
    assert t.router_rss_per_min == pytest.approx(2 * MIB)
    assert t.engines_rss_per_min == pytest.approx(0.0)
    assert t.first_p99_s == pytest.approx(0.05)
    assert t.last_p99_s == pytest.approx(0.11)
    assert t.p99_ratio == pytest.approx(2.2)


def test_slope_needs_two_distinct_points() -> None:
    """A single sample has no slope; mismatched lengths are an error that names both."""
    assert slope([1.0], [5.0]) is None
    assert slope([1.0, 1.0], [5.0, 6.0]) is None
    assert slope([0.0, 1.0, 2.0], [1.0, 3.0, 5.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="got 2 and 1"):
        slope([1.0, 2.0], [1.0])


def test_rss_of_this_process_and_of_a_missing_one() -> None:
    """RSS is read from /proc for a live PID; a PID that does not exist gives None."""
    mine = rss_bytes(os.getpid())
    assert mine is not None and mine > 10 * MIB
    assert rss_bytes(2**22 + 12345) is None
