"""The report's PNG plots, drawn with matplotlib's object API (never pyplot).

Each function draws one figure into ``path`` and returns whether it had data to draw
(``False``: no file written, the page leaves the figure out). ``Figure`` + the Agg canvas
touch no global backend or figure state, so plots are safe in any process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from preheat.telemetry.inventory import NodeInventory
from preheat.telemetry.records import STAGES, EventClass, StartRecord
from preheat.telemetry.routing import RouteDecision, RoutingStats
from preheat.telemetry.stats import READY, StageStats

__all__ = [
    "cache_hit_ratio",
    "inventory",
    "kv_hit_rate",
    "predicted_vs_actual",
    "readiness_cdf",
    "route_share",
    "stage_breakdown",
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


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)


def _finish(
    fig: Figure,
    path: Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
    legend_loc: Literal["best", "lower right"] = "best",
) -> bool:
    """Label the (only) axes of a line or scatter plot, grid it, add the legend, save."""
    (ax,) = fig.axes
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc=legend_loc, fontsize=8)
    _save(fig, path)
    return True


def readiness_cdf(records: Sequence[StartRecord], path: Path) -> bool:
    """Readiness (scheduled -> healthy) CDF, one staircase per event class."""
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
    return _finish(
        fig,
        path,
        title="Readiness CDF per event class",
        xlabel="seconds from scheduled to healthy",
        ylabel="fraction of starts",
        ylim=(0, 1.02),
        legend_loc="lower right",
    )


def stage_breakdown(rows: Sequence[StageStats], path: Path) -> bool:
    """Median seconds per stage, stacked, one bar per event class."""
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


def cache_hit_ratio(records: Sequence[StartRecord], path: Path) -> bool:
    """Weights cache hit ratio of starts per interval and cumulatively, over time."""
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
    return _finish(
        fig,
        path,
        title="Cache hit ratio of replica starts over time",
        xlabel="seconds since the first start",
        ylabel="weights cache hit ratio",
        ylim=(0, 1.05),
    )


def inventory(nodes: Sequence[NodeInventory], path: Path) -> bool:
    """Per node: bytes per revision and free space, stacked."""
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


def route_share(stats: Sequence[RoutingStats], path: Path) -> bool:
    """Per-instance share of routed requests, one bar group per strategy."""
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


def kv_hit_rate(rows: Sequence[RouteDecision], path: Path) -> bool:
    """Engine-reported (solid) and predicted (dashed) KV hit rate over time, per strategy."""
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
            pred[b] += r.predicted_cached_tokens or 0
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
    return _finish(
        fig,
        path,
        title="KV cache hit rate over time",
        xlabel="seconds since the first request",
        ylabel="cached tokens / prompt tokens",
        ylim=(0, 1.05),
    )


def predicted_vs_actual(rows: Sequence[RouteDecision], path: Path) -> bool:
    """Router-predicted vs engine-reported cached tokens, one point per request."""
    reported = [r for r in rows if r.actual_cached_tokens is not None]
    if not reported:
        return False
    fig = Figure(figsize=(5.5, 5), layout="constrained")
    ax = fig.add_subplot()
    top = 1.0
    for strategy in sorted({r.strategy for r in reported}):
        rs = [r for r in reported if r.strategy == strategy]
        xs = [r.predicted_cached_tokens or 0 for r in rs]
        ys = [r.actual_cached_tokens or 0 for r in rs]
        top = max(top, *xs, *ys)
        ax.scatter(xs, ys, s=8, alpha=0.5, label=strategy)
    ax.plot([0, top], [0, top], color="#5c6578", lw=1, ls="--", label="prediction = actual")
    return _finish(
        fig,
        path,
        title="Predicted vs actual prefix hits per request",
        xlabel="router-predicted cached tokens",
        ylabel="engine-reported cached tokens",
    )
