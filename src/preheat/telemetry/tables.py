"""The report's tables as rows of text: what each cell says, for the terminal and the page.

Each ``*_table`` function returns ``(headers, rows)`` of strings; ``preheat.telemetry.htmlpage``
draws them as HTML, ``stage_table_rich`` as a rich table for the terminal. Times are
formatted by ``seconds`` (``850 ms``, ``2.40 s``, ``12.5 min``) everywhere, so the terminal
and the page print the same figure for the same percentile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.table import Table

from preheat.config import format_size
from preheat.telemetry.inventory import NodeInventory
from preheat.telemetry.records import WEIGHTS_SOURCES, StartRecord
from preheat.telemetry.routing import RoutingStats
from preheat.telemetry.stats import READY, ClassSummary, stage_table

__all__ = [
    "Rows",
    "class_table",
    "failed_table",
    "inventory_table",
    "percent",
    "routing_summary_table",
    "routing_table",
    "seconds",
    "stage_table_rich",
]

#: Column headers and the rows under them, every cell already text.
Rows = tuple[list[str], list[list[str]]]


def seconds(x: float) -> str:
    """Seconds for a reader: milliseconds below 1 s, minutes from 10 min."""
    if x < 1:
        return f"{x * 1000:.0f} ms"
    if x < 600:
        return f"{x:.2f} s"
    return f"{x / 60:.1f} min"


def percent(x: float | None) -> str:
    """A ratio as a percentage with one decimal; ``-`` when there is none."""
    return "-" if x is None else f"{100 * x:.1f}%"


def _value(v: Any) -> str:
    if isinstance(v, Mapping):
        return ", ".join(f"{k}: {_value(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def stage_table_rich(records: Sequence[StartRecord]) -> Table:
    """p50/p95/p99 per event class and stage, for the terminal."""
    t = Table(title="Replica start time by event class and stage (p50 / p95 / p99)")
    for col, justify in (
        ("event class", "left"),
        ("stage", "left"),
        ("n", "right"),
        ("p50", "right"),
        ("p95", "right"),
        ("p99", "right"),
    ):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    last = None
    for row in stage_table(records):
        cls = row.event_class.value if row.event_class != last else ""
        if row.event_class != last and last is not None:
            t.add_section()
        last = row.event_class
        p = row.seconds
        stage = f"[bold]{row.stage}[/bold]" if row.stage == READY else row.stage
        t.add_row(cls, stage, str(p.n), seconds(p.p50), seconds(p.p95), seconds(p.p99))
    return t


def class_table(summaries: Sequence[ClassSummary]) -> Rows:
    """Per event class: starts, failures, weights cache hits, image cache hits (``-``
    for starts without an image), bytes by source, readiness. Image time per class is
    the ``image_ready`` stage of ``stage_table``."""
    headers = [
        "event class",
        "starts",
        "failed",
        "weights cache hits",
        "image cache hits",
        *(f"bytes from {s}" for s in WEIGHTS_SOURCES),
        "ready p50",
        "ready p95",
        "ready p99",
    ]
    rows = []
    for s in summaries:
        ready = s.ready
        rows.append(
            [
                s.event_class.value,
                str(s.starts),
                str(s.failures),
                percent(s.hit_ratio),
                _image_hits(s),
                *(format_size(s.bytes_from.get(src, 0)) for src in WEIGHTS_SOURCES),
                "-" if ready is None else seconds(ready.p50),
                "-" if ready is None else seconds(ready.p95),
                "-" if ready is None else seconds(ready.p99),
            ]
        )
    return headers, rows


def _image_hits(s: ClassSummary) -> str:
    """``67% (2/3)``: starts whose image was on the node, of those that used one."""
    total = s.image_hits + s.image_misses
    if total == 0:
        return "-"
    return f"{percent(s.image_hits / total)} ({s.image_hits}/{total})"


def failed_table(records: Iterable[StartRecord]) -> Rows:
    """The starts that never became healthy, with their reason."""
    return (
        ["replica", "node", "event class", "reason"],
        [
            [r.replica, r.node, r.event_class.value, r.failure or "never healthy"]
            for r in records
            if not r.ok
        ],
    )


def inventory_table(inventory: Sequence[NodeInventory]) -> Rows:
    """One row per snapshot on each node, then the node's free space (and last failure)."""
    rows = []
    for n in inventory:
        for s in n.snapshots or ():
            rows.append(
                [
                    n.node,
                    s.revision,
                    format_size(s.size_bytes),
                    ", ".join(s.leased_by) or "-",
                    "yes" if s.pinned else "no",
                    str(s.priority),
                    {True: "yes", False: "no", None: "-"}[n.ready.get(s.revision)],
                ]
            )
        rows.append(
            [
                n.node,
                "(free)",
                format_size(n.free_bytes),
                "",
                "",
                "",
                ""
                if n.last_warmup_failure is None
                else f"last warm-up failed: {n.last_warmup_failure.reason}",
            ]
        )
    return ["node", "revision", "bytes", "leased by", "pinned", "priority", "ready"], rows


def routing_summary_table(summary: Mapping[str, Mapping[str, Any]]) -> Rows:
    """Per-strategy figures measured elsewhere (strategy -> {column: value})."""
    cols: list[str] = []
    for metrics in summary.values():
        cols.extend(k for k in metrics if k not in cols)
    return (
        ["strategy", *cols],
        [[name, *(_value(m.get(c, "-")) for c in cols)] for name, m in summary.items()],
    )


def routing_table(stats: Sequence[RoutingStats]) -> Rows:
    """Per strategy: sampled decisions, hit rates, prediction error, decision time, shares."""
    headers = [
        "strategy",
        "decisions (sampled)",
        "KV hit rate (engine)",
        "predicted hit rate",
        "mean |pred - actual| tokens",
        "decision p50",
        "decision p99",
        "shares",
    ]
    rows = [
        [
            s.strategy,
            str(s.decisions),
            percent(s.kv_hit_rate),
            percent(s.predicted_hit_rate),
            "-" if s.mean_abs_error_tokens is None else f"{s.mean_abs_error_tokens:.1f}",
            f"{s.decision_us_p50:.1f} us",
            f"{s.decision_us_p99:.1f} us",
            ", ".join(f"{k.removeprefix('http://')}: {100 * v:.0f}%" for k, v in s.shares.items()),
        ]
        for s in stats
    ]
    return headers, rows
