"""Percentiles per event class and stage, checked against numpy on the same samples."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from preheat.telemetry.events import STAGES, EventClass
from preheat.telemetry.stats import READY, percentile, stage_table, summarize_classes
from preheat.testing.telemetry import synthetic_starts


def test_percentile_matches_numpy_linear() -> None:
    """Linear interpolation agrees with numpy.percentile for many sizes and quantiles."""
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 10, 101):
        xs = rng.exponential(5.0, n).tolist()
        for q in (0, 50, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_rejects_bad_input() -> None:
    """An empty sample or a q outside 0..100 is an error that says so."""
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"outside 0\.\.100"):
        percentile([1.0], 101)


def test_stage_table_is_per_class_never_blended() -> None:
    """Every row holds the samples of one class only, in stage order, ready last."""
    records = synthetic_starts(60, seed=1)
    rows = stage_table(records)
    assert {r.event_class for r in rows} == set(EventClass)
    for cls in EventClass:
        mine = [r for r in records if r.event_class is cls]
        cls_rows = [r for r in rows if r.event_class is cls]
        assert [r.stage for r in cls_rows] == [*STAGES, READY]
        for row in cls_rows:
            if row.stage == READY:
                values = [r.ready_seconds for r in mine]
            else:
                values = [r.stage_durations()[row.stage] for r in mine]
            assert row.seconds.n == len(mine)
            assert row.seconds.p50 == pytest.approx(float(np.percentile(values, 50)))
            assert row.seconds.p95 == pytest.approx(float(np.percentile(values, 95)))
            assert row.seconds.p99 == pytest.approx(float(np.percentile(values, 99)))
    # The cold class is slower than every warm one in the fetch stage: classes differ.
    fetch = {r.event_class: r.seconds.p50 for r in rows if r.stage == "weights_ready"}
    assert all(
        fetch[EventClass.NEW_NODE] > 100 * v
        for c, v in fetch.items()
        if c is not EventClass.NEW_NODE
    )


def test_failed_starts_count_stages_but_not_readiness() -> None:
    """A start that never got healthy adds its completed stages and no ready time."""
    records = synthetic_starts(12, seed=2, failures=2)
    failed = [r for r in records if not r.ok]
    assert len(failed) == 2
    rows = {(r.event_class, r.stage): r.seconds.n for r in stage_table(records)}
    for r in failed:
        total = sum(1 for x in records if x.event_class is r.event_class)
        assert rows[(r.event_class, "image_ready")] == total
        assert rows[(r.event_class, READY)] == total - 1
    summaries = {s.event_class: s for s in summarize_classes(records)}
    assert sum(s.failures for s in summaries.values()) == 2


def test_class_summary_counts_hits_and_bytes() -> None:
    """Hits, misses and bytes by source add up per class."""
    records = synthetic_starts(30, seed=4)
    for s in summarize_classes(records):
        mine = [r for r in records if r.event_class is s.event_class]
        assert s.starts == len(mine)
        assert s.weights_hits + s.weights_misses == len(mine)
        for source in ("cache", "peer", "origin"):
            assert s.bytes_from[source] == sum(r.bytes_from.get(source, 0) for r in mine)
        if s.event_class is EventClass.NEW_NODE:
            assert s.hit_ratio == 0.0 and s.bytes_from["origin"] > 0
        else:
            assert s.hit_ratio == 1.0 and s.bytes_from["origin"] == 0


def _rank_statistics(tree: ast.AST, *, allowed_def: str = "") -> list[int]:
    """Lines that compute a percentile or quantile some other way than ``stats.percentile``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == allowed_def:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
            w in node.name.lower() for w in ("percentile", "quantile", "median")
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in {
            "percentile",
            "quantile",
            "quantiles",
            "median",
            "nanpercentile",
            "nanquantile",
        }:
            # numpy / statistics / a second import of our own under another name
            if not (isinstance(node.value, ast.Name) and node.value.id == "stats"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript):
            # Nearest rank: xs[int(q * len(xs))], xs[len(xs) // 2], xs[min(n - 1, ...)].
            inner = list(ast.walk(node.slice))
            has_len = any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "len"
                for n in inner
            )
            scales = any(
                isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult | ast.FloorDiv)
                for n in inner
            )
            if has_len and scales:
                lines.append(node.lineno)
    return sorted(set(lines))


def test_src_has_one_percentile_function() -> None:
    """No module under src/ computes a percentile, quantile or median but ``stats.percentile``."""
    src = Path(__file__).resolve().parents[2] / "src" / "preheat"
    found = {}
    for path in sorted(src.rglob("*.py")):
        own = "percentile" if path == src / "telemetry" / "stats.py" else ""
        lines = _rank_statistics(ast.parse(path.read_text(), str(path)), allowed_def=own)
        if lines:
            found[str(path.relative_to(src))] = lines
    assert found == {}


def test_rank_statistics_finder_sees_the_usual_shapes() -> None:
    """The scan above flags nearest-rank indexing, numpy/statistics calls and own helpers."""
    code = (
        "def p99(xs):\n    return xs[int(0.99 * len(xs))]\n"
        "m = ys[len(ys) // 2]\n"
        "import numpy as np\nq = np.percentile(ys, 90)\n"
        "import statistics\nr = statistics.quantiles(ys, n=100)\n"
        "ok = ys[rng.randrange(len(ys))]\n"
        "from preheat.telemetry import stats\nfine = stats.percentile(ys, 50)\n"
    )
    assert _rank_statistics(ast.parse(code)) == [2, 3, 5, 7]
