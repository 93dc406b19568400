"""The start-time report: terminal tables, PNG plots and one self-contained HTML page.

``write_report(events, out_dir, ...)`` writes ``out_dir/index.html`` and its PNGs (linked
relatively; no external CSS or JS, so the directory can be copied, archived or opened
from disk). Plots use matplotlib's object API (``Figure`` + the Agg canvas), never
pyplot, so no global backend or figure state is touched.

Sections, each present only when it has data:

- per event class: starts, failures, weights cache hit ratio, bytes by source, readiness
  p50/p95/p99; per class and stage: p50/p95/p99 (never one blended mean);
- ``readiness_cdf.png``: readiness (scheduled -> healthy) CDF per event class;
- ``stage_breakdown.png``: median seconds per stage, stacked, one bar per class;
- ``cache_hit_ratio.png``: weights cache hit ratio of starts over time;
- ``inventory.png``: per-node bytes per snapshot and free space;
- routing runs (a decisions JSONL of ``RouteDecision`` records): per-instance share,
  KV hit rate over time (engine-reported cached tokens / prompt tokens) next to the
  router's prediction, and predicted vs actual cached tokens per request.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.table import Table

from preheat.config import format_size
from preheat.telemetry.events import STAGES, WEIGHTS_SOURCES, EventClass, StartRecord, read_jsonl
from preheat.telemetry.inventory import NodeInventory
from preheat.telemetry.stats import (
    READY,
    ClassSummary,
    StageStats,
    percentile,
    stage_table,
    summarize_classes,
)

__all__ = [
    "RouteRow",
    "RoutingStats",
    "read_route_decisions",
    "routing_stats",
    "stage_table_rich",
    "write_report",
]

_CLASS_COLORS = {
    EventClass.WARM_RESTART: "#2a9d8f",
    EventClass.COLD_POD_WARM_NODE: "#4c78a8",
    EventClass.NEW_NODE: "#e45756",
    EventClass.NEW_VERSION: "#f58518",
    EventClass.NODE_LOSS_RECOVERY: "#9d755d",
    EventClass.SCALE_OUT: "#b279a2",
}
_STAGE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"]


# --- route decisions -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouteRow:
    """The fields of a ``RouteDecision`` JSONL line that the report uses."""

    ts: float
    variant: str
    strategy: str
    instance: str | None
    outcome: str
    predicted_cached_tokens: int
    actual_cached_tokens: int | None
    prompt_tokens: int | None
    decision_us: float

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RouteRow:
        missing = [
            k
            for k in ("ts", "variant", "strategy", "instance", "outcome", "decision_us")
            if k not in d
        ]
        if missing:
            raise ValueError(f"route decision is missing keys {missing}")
        actual = d.get("actual_cached_tokens")
        prompt = d.get("prompt_tokens")
        return cls(
            ts=float(d["ts"]),
            variant=str(d["variant"]),
            strategy=str(d["strategy"]),
            instance=None if d["instance"] is None else str(d["instance"]),
            outcome=str(d["outcome"]),
            predicted_cached_tokens=int(d.get("predicted_cached_tokens") or 0),
            actual_cached_tokens=None if actual is None else int(actual),
            prompt_tokens=None if prompt is None else int(prompt),
            decision_us=float(d["decision_us"]),
        )


def read_route_decisions(path: str | os.PathLike[str]) -> list[RouteRow]:
    """Route decisions from a JSONL file (torn lines skipped)."""
    return read_jsonl(path, RouteRow.from_dict).records


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


def routing_stats(rows: Sequence[RouteRow]) -> list[RoutingStats]:
    groups: dict[str, list[RouteRow]] = {}
    for r in rows:
        groups.setdefault(r.strategy, []).append(r)
    out = []
    for strategy in sorted(groups):
        rs = groups[strategy]
        counts: dict[str, int] = {}
        for r in rs:
            if r.instance is not None:
                counts[r.instance] = counts.get(r.instance, 0) + 1
        routed = sum(counts.values())
        shares = {k: v / routed for k, v in sorted(counts.items())} if routed else {}
        reported = [r for r in rs if r.actual_cached_tokens is not None and r.prompt_tokens]
        prompt = sum(r.prompt_tokens or 0 for r in reported)
        actual = sum(r.actual_cached_tokens or 0 for r in reported)
        predicted = sum(r.predicted_cached_tokens for r in reported)
        err = [abs(r.predicted_cached_tokens - (r.actual_cached_tokens or 0)) for r in reported]
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


# --- terminal -------------------------------------------------------------------------------


def _s(x: float) -> str:
    if x < 1:
        return f"{x * 1000:.0f} ms"
    if x < 600:
        return f"{x:.2f} s"
    return f"{x / 60:.1f} min"


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
        t.add_row(cls, stage, str(p.n), _s(p.p50), _s(p.p95), _s(p.p99))
    return t


# --- plots ----------------------------------------------------------------------------------


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)


def _plot_readiness_cdf(records: Sequence[StartRecord], path: Path) -> bool:
    by_class: dict[EventClass, list[float]] = {}
    for r in records:
        if r.ok and r.ready_seconds is not None:
            by_class.setdefault(r.event_class, []).append(r.ready_seconds)
    if not by_class:
        return False
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    positive = all(v > 0 for vs in by_class.values() for v in vs)
    for cls in EventClass:
        vs = sorted(by_class.get(cls, []))
        if not vs:
            continue
        # Start the staircase at 0 so a class with one start still draws a visible riser.
        xs = [vs[0], *vs]
        ys = [0.0, *((i + 1) / len(vs) for i in range(len(vs)))]
        ax.step(
            xs,
            ys,
            where="post",
            label=f"{cls.value} (n={len(vs)})",
            color=_CLASS_COLORS[cls],
            lw=1.8,
        )
    if (
        positive
        and max(max(v) for v in by_class.values())
        / max(min(min(v) for v in by_class.values()), 1e-9)
        > 20
    ):
        ax.set_xscale("log")
    ax.set_xlabel("seconds from scheduled to healthy")
    ax.set_ylabel("fraction of starts")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title("Readiness CDF per event class")
    ax.legend(loc="lower right", fontsize=8)
    _save(fig, path)
    return True


def _plot_stage_breakdown(rows: Sequence[StageStats], path: Path) -> bool:
    medians: dict[EventClass, dict[str, float]] = {}
    for row in rows:
        if row.stage != READY:
            medians.setdefault(row.event_class, {})[row.stage] = row.seconds.p50
    if not medians:
        return False
    classes = [c for c in EventClass if c in medians]
    fig = Figure(figsize=(8, 0.6 * len(classes) + 2.0), layout="constrained")
    ax = fig.add_subplot()
    left = [0.0] * len(classes)
    ypos = list(range(len(classes)))
    for i, stage in enumerate(STAGES):
        widths = [medians[c].get(stage, 0.0) for c in classes]
        if not any(widths):
            continue
        ax.barh(ypos, widths, left=left, label=stage, color=_STAGE_COLORS[i % len(_STAGE_COLORS)])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(ypos, [c.value for c in classes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median of each stage)")
    ax.set_title("Where start-up time goes: median per stage, by event class")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncols=3, loc="lower right")
    _save(fig, path)
    return True


def _bins(ts: Sequence[float], n_max: int = 20) -> tuple[float, float, int]:
    lo, hi = min(ts), max(ts)
    n = max(1, min(n_max, len(ts) // 3 or 1))
    return lo, (hi - lo) / n if hi > lo else 1.0, n


def _plot_hit_ratio(records: Sequence[StartRecord], path: Path) -> bool:
    if not records:
        return False
    rs = sorted(records, key=lambda r: r.scheduled)
    t0 = rs[0].scheduled
    ts = [r.scheduled - t0 for r in rs]
    lo, width, n = _bins(ts)
    hits = [0] * n
    total = [0] * n
    for t, r in zip(ts, rs, strict=True):
        b = min(n - 1, int((t - lo) / width))
        total[b] += 1
        hits[b] += 1 if r.cache_hit else 0
    xs = [lo + (i + 0.5) * width for i in range(n) if total[i]]
    ys = [hits[i] / total[i] for i in range(n) if total[i]]
    cum_x, cum_y, h = [], [], 0
    for i, (t, r) in enumerate(zip(ts, rs, strict=True), 1):
        h += 1 if r.cache_hit else 0
        cum_x.append(t)
        cum_y.append(h / i)
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(xs, ys, width=width * 0.9, alpha=0.5, color="#4c78a8", label="per interval")
    ax.plot(cum_x, cum_y, color="#e45756", label="cumulative")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since the first start")
    ax.set_ylabel("weights cache hit ratio")
    ax.set_title("Cache hit ratio of replica starts over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def _plot_inventory(nodes: Sequence[NodeInventory], path: Path) -> bool:
    if not nodes:
        return False
    fig = Figure(figsize=(8, 0.5 * len(nodes) + 2.0), layout="constrained")
    ax = fig.add_subplot()
    revisions: list[str] = []
    for n in nodes:
        for s in n.snapshots:
            if s.revision not in revisions:
                revisions.append(s.revision)
    gib = 1024**3
    ypos = list(range(len(nodes)))
    left = [0.0] * len(nodes)
    palette = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#9d755d", "#eeca3b"]
    for i, rev in enumerate(revisions):
        widths = [sum(s.size_bytes for s in n.snapshots if s.revision == rev) / gib for n in nodes]
        label = rev if len(rev) <= 24 else rev[:21] + "..."
        ax.barh(ypos, widths, left=left, label=label, color=palette[i % len(palette)])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    free = [n.free_bytes / gib for n in nodes]
    ax.barh(ypos, free, left=left, label="free", color="#e6e8ec", edgecolor="#b8bcc6")
    ax.set_yticks(ypos, [n.node for n in nodes])
    ax.invert_yaxis()
    ax.set_xlabel("GiB")
    ax.set_title("Node cache inventory: bytes per revision and free space")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)
    return True


def _plot_route_share(stats: Sequence[RoutingStats], path: Path) -> bool:
    instances = sorted({i for s in stats for i in s.shares})
    if not instances:
        return False
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    k = len(stats)
    width = 0.8 / k
    for j, s in enumerate(stats):
        xs = [i + (j - (k - 1) / 2) * width for i in range(len(instances))]
        ax.bar(xs, [s.shares.get(i, 0.0) for i in instances], width=width, label=s.strategy)
    ax.axhline(1 / len(instances), color="#5c6578", ls="--", lw=1, label="even share")
    labels = [i.removeprefix("http://").removeprefix("https://") for i in instances]
    ax.set_xticks(range(len(instances)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("share of routed requests")
    ax.set_title("Per-instance share of requests, by routing strategy")
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def _plot_kv_hit_over_time(rows: Sequence[RouteRow], path: Path) -> bool:
    reported = [r for r in rows if r.actual_cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return False
    t0 = min(r.ts for r in reported)
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    for strategy in sorted({r.strategy for r in reported}):
        rs = sorted((r for r in reported if r.strategy == strategy), key=lambda r: r.ts)
        ts = [r.ts - t0 for r in rs]
        lo, width, n = _bins(ts)
        act = [0] * n
        pred = [0] * n
        prm = [0] * n
        for t, r in zip(ts, rs, strict=True):
            b = min(n - 1, int((t - lo) / width))
            act[b] += r.actual_cached_tokens or 0
            pred[b] += r.predicted_cached_tokens
            prm[b] += r.prompt_tokens or 0
        xs = [lo + (i + 0.5) * width for i in range(n) if prm[i]]
        line = ax.plot(xs, [act[i] / prm[i] for i in range(n) if prm[i]], marker="o", ms=3)
        ax.plot(
            xs,
            [pred[i] / prm[i] for i in range(n) if prm[i]],
            ls="--",
            color=line[0].get_color(),
            alpha=0.7,
        )
        line[0].set_label(f"{strategy}: engine-reported (dashed: predicted)")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("cached tokens / prompt tokens")
    ax.set_title("KV cache hit rate over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def _plot_predicted_vs_actual(rows: Sequence[RouteRow], path: Path) -> bool:
    reported = [r for r in rows if r.actual_cached_tokens is not None]
    if not reported:
        return False
    fig = Figure(figsize=(5.5, 5), layout="constrained")
    ax = fig.add_subplot()
    top = 1.0
    for strategy in sorted({r.strategy for r in reported}):
        rs = [r for r in reported if r.strategy == strategy]
        xs = [r.predicted_cached_tokens for r in rs]
        ys = [r.actual_cached_tokens or 0 for r in rs]
        top = max(top, *xs, *ys)
        ax.scatter(xs, ys, s=8, alpha=0.5, label=strategy)
    ax.plot([0, top], [0, top], color="#5c6578", lw=1, ls="--", label="prediction = actual")
    ax.set_xlabel("router-predicted cached tokens")
    ax.set_ylabel("engine-reported cached tokens")
    ax.set_title("Predicted vs actual prefix hits per request")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


# --- HTML -----------------------------------------------------------------------------------


def _e(x: object) -> str:
    return html.escape(str(x))


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for c in row:
            num = c[:1].isdigit() or (c.startswith("-") and c[1:2].isdigit())
            cells.append(f'<td class="num">{_e(c)}</td>' if num else f"<td>{_e(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    )


def _stage_matrix(rows: Sequence[StageStats]) -> str:
    """Event classes down, stages (and ready) across, three rows per class: p50/p95/p99."""
    cells: dict[tuple[EventClass, str], StageStats] = {(r.event_class, r.stage): r for r in rows}
    stages = [s for s in (*STAGES, READY) if any(k[1] == s for k in cells)]
    classes = [c for c in EventClass if any(k[0] == c for k in cells)]
    head = "<th>event class</th><th>n</th><th></th>" + "".join(f"<th>{_e(s)}</th>" for s in stages)
    body = []
    for cls in classes:
        n = max(r.seconds.n for (c, _), r in cells.items() if c == cls)
        for q in ("p50", "p95", "p99"):
            lead = (
                f'<td rowspan="3">{_e(cls.value)}</td><td class="num" rowspan="3">{n}</td>'
                if q == "p50"
                else ""
            )
            tds = []
            for stage in stages:
                row = cells.get((cls, stage))
                val = "-" if row is None else _s(getattr(row.seconds, q))
                tds.append(f'<td class="num">{_e(val)}</td>')
            body.append(
                f'<tr data-class="{_e(cls.value)}" data-q="{q}">{lead}<td>{q}</td>{"".join(tds)}</tr>'
            )
    return (
        f'<table class="stages"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def _fig(name: str, caption: str) -> str:
    return (
        f'<figure><img src="{_e(name)}" alt="{_e(caption)}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _class_rows(summaries: Sequence[ClassSummary]) -> list[list[str]]:
    rows = []
    for s in summaries:
        ready = s.ready
        rows.append(
            [
                s.event_class.value,
                str(s.starts),
                str(s.failures),
                _pct(s.hit_ratio),
                *(format_size(s.bytes_from.get(src, 0)) for src in WEIGHTS_SOURCES),
                "-" if ready is None else _s(ready.p50),
                "-" if ready is None else _s(ready.p95),
                "-" if ready is None else _s(ready.p99),
            ]
        )
    return rows


def _fmt_value(v: Any) -> str:
    if isinstance(v, Mapping):
        return ", ".join(f"{k}: {_fmt_value(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_report(
    events: Sequence[StartRecord],
    out_dir: str | os.PathLike[str],
    *,
    route_decisions_path: str | os.PathLike[str] | None = None,
    inventory: Sequence[NodeInventory] | None = None,
    routing_summary: Mapping[str, Mapping[str, Any]] | None = None,
    title: str = "preheat start-time report",
) -> Path:
    """Write ``out_dir/index.html`` and its PNG plots; return the path of the page.

    ``routing_summary`` is an optional table of per-strategy figures measured elsewhere
    (for example the demo's TTFT percentiles), strategy -> {column: value}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[str] = []
    records = list(events)
    rows = stage_table(records)

    parts.append("<h2>Starts by event class</h2>")
    if records:
        parts.append(
            _table(
                [
                    "event class",
                    "starts",
                    "failed",
                    "weights cache hits",
                    *(f"bytes from {s}" for s in WEIGHTS_SOURCES),
                    "ready p50",
                    "ready p95",
                    "ready p99",
                ],
                _class_rows(summarize_classes(records)),
                cls="classes",
            )
        )
        parts.append("<h2>Stage percentiles per event class</h2>")
        parts.append(
            '<p class="note">Each stage is the time between two consecutive recorded '
            "boundaries; <b>ready</b> is scheduled to healthy. Percentiles are within one "
            "event class, never across classes.</p>"
        )
        parts.append(_stage_matrix(rows))
        failed = [r for r in records if not r.ok]
        if failed:
            parts.append("<h2>Failed starts</h2>")
            parts.append(
                _table(
                    ["replica", "node", "event class", "reason"],
                    (
                        [r.replica, r.node, r.event_class.value, r.failure or "never healthy"]
                        for r in failed
                    ),
                    cls="failures",
                )
            )
    else:
        parts.append('<p class="note">No start records.</p>')

    if _plot_readiness_cdf(records, out / "readiness_cdf.png"):
        parts.append(_fig("readiness_cdf.png", "Readiness CDF per event class"))
    if _plot_stage_breakdown(rows, out / "stage_breakdown.png"):
        parts.append(_fig("stage_breakdown.png", "Median seconds per stage, stacked, per class"))
    if _plot_hit_ratio(records, out / "cache_hit_ratio.png"):
        parts.append(_fig("cache_hit_ratio.png", "Weights cache hit ratio of starts over time"))

    if inventory:
        parts.append("<h2>Node cache inventory</h2>")
        inv_rows = []
        for n in inventory:
            for s in n.snapshots or ():
                inv_rows.append(
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
            inv_rows.append(
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
        parts.append(
            _table(
                ["node", "revision", "bytes", "leased by", "pinned", "priority", "ready"],
                inv_rows,
                cls="inventory",
            )
        )
        if _plot_inventory(inventory, out / "inventory.png"):
            parts.append(_fig("inventory.png", "Bytes per revision and free space per node"))

    route_rows: list[RouteRow] = []
    if route_decisions_path is not None:
        route_rows = read_route_decisions(route_decisions_path)
    if routing_summary or route_rows:
        parts.append("<h2>Routing</h2>")
    if routing_summary:
        cols: list[str] = []
        for metrics in routing_summary.values():
            cols.extend(k for k in metrics if k not in cols)
        parts.append(
            _table(
                ["strategy", *cols],
                (
                    [name, *(_fmt_value(m.get(c, "-")) for c in cols)]
                    for name, m in routing_summary.items()
                ),
                cls="routing-summary",
            )
        )
    if route_rows:
        stats = routing_stats(route_rows)
        parts.append(
            _table(
                [
                    "strategy",
                    "decisions (sampled)",
                    "KV hit rate (engine)",
                    "predicted hit rate",
                    "mean |pred - actual| tokens",
                    "decision p50",
                    "decision p99",
                    "shares",
                ],
                (
                    [
                        s.strategy,
                        str(s.decisions),
                        _pct(s.kv_hit_rate),
                        _pct(s.predicted_hit_rate),
                        "-"
                        if s.mean_abs_error_tokens is None
                        else f"{s.mean_abs_error_tokens:.1f}",
                        f"{s.decision_us_p50:.1f} us",
                        f"{s.decision_us_p99:.1f} us",
                        ", ".join(
                            f"{k.removeprefix('http://')}: {100 * v:.0f}%"
                            for k, v in s.shares.items()
                        ),
                    ]
                    for s in stats
                ),
                cls="routing",
            )
        )
        if _plot_route_share(stats, out / "route_share.png"):
            parts.append(_fig("route_share.png", "Per-instance share of routed requests"))
        if _plot_kv_hit_over_time(route_rows, out / "kv_hit_rate.png"):
            parts.append(_fig("kv_hit_rate.png", "KV cache hit rate over time"))
        if _plot_predicted_vs_actual(route_rows, out / "predicted_vs_actual.png"):
            parts.append(
                _fig("predicted_vs_actual.png", "Router-predicted vs engine-reported cached tokens")
            )

    span = ""
    if records:
        first = min(r.scheduled for r in records)
        last = max(r.scheduled for r in records)
        span = (
            f" covering {_s(last - first) if last > first else 'one instant'} from "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(first))} UTC"
        )
    meta = (
        f"{len(records)} start records{span}; "
        f"{len(route_rows)} routing decisions. Generated "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC."
    )
    template = Template(
        resources.files("preheat.telemetry").joinpath("report.html").read_text(encoding="utf-8")
    )
    page = template.substitute(title=_e(title), meta=_e(meta), body="\n".join(parts))
    index = out / "index.html"
    tmp = out / ".index.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, index)
    return index
