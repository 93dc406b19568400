"""The start-time report: which sections, in which order, written to one directory.

``write_report(events, out_dir, ...)`` writes ``out_dir/index.html`` and its PNGs (linked
relatively; no external CSS or JS, so the directory can be copied, archived or opened
from disk). The parts live apart: ``tables`` (what each cell says; also the terminal
table), ``plots`` (the PNGs), ``htmlpage`` (escaping, tables, the page template) and
``routing`` (reading and summarising the router's decision log).

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

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from preheat.telemetry import htmlpage, plots, tables
from preheat.telemetry.inventory import NodeInventory
from preheat.telemetry.records import StartRecord
from preheat.telemetry.routing import RouteDecision, read_decisions, routing_stats
from preheat.telemetry.stats import stage_table, summarize_classes
from preheat.telemetry.tables import stage_table_rich

__all__ = ["stage_table_rich", "write_report"]


def _starts(records: Sequence[StartRecord], out: Path) -> list[str]:
    parts = ["<h2>Starts by event class</h2>"]
    rows = stage_table(records)
    if records:
        headers, cells = tables.class_table(summarize_classes(records))
        parts.append(htmlpage.table(headers, cells, cls="classes"))
        parts.append("<h2>Stage percentiles per event class</h2>")
        parts.append(
            '<p class="note">Each stage is the time between two consecutive recorded '
            "boundaries; <b>ready</b> is scheduled to healthy. Percentiles are within one "
            "event class, never across classes.</p>"
        )
        parts.append(htmlpage.stage_matrix(rows))
        if any(not r.ok for r in records):
            parts.append("<h2>Failed starts</h2>")
            headers, cells = tables.failed_table(records)
            parts.append(htmlpage.table(headers, cells, cls="failures"))
    else:
        parts.append('<p class="note">No start records.</p>')
    if plots.readiness_cdf(records, out / "readiness_cdf.png"):
        parts.append(htmlpage.figure("readiness_cdf.png", "Readiness CDF per event class"))
    if plots.stage_breakdown(rows, out / "stage_breakdown.png"):
        parts.append(
            htmlpage.figure("stage_breakdown.png", "Median seconds per stage, stacked, per class")
        )
    if plots.cache_hit_ratio(records, out / "cache_hit_ratio.png"):
        parts.append(
            htmlpage.figure("cache_hit_ratio.png", "Weights cache hit ratio of starts over time")
        )
    return parts


def _inventory(inventory: Sequence[NodeInventory], out: Path) -> list[str]:
    headers, cells = tables.inventory_table(inventory)
    parts = ["<h2>Node cache inventory</h2>", htmlpage.table(headers, cells, cls="inventory")]
    if plots.inventory(inventory, out / "inventory.png"):
        parts.append(htmlpage.figure("inventory.png", "Bytes per revision and free space per node"))
    return parts


def _routing(
    summary: Mapping[str, Mapping[str, Any]] | None, decisions: Sequence[RouteDecision], out: Path
) -> list[str]:
    if not summary and not decisions:
        return []
    parts = ["<h2>Routing</h2>"]
    if summary:
        headers, cells = tables.routing_summary_table(summary)
        parts.append(htmlpage.table(headers, cells, cls="routing-summary"))
    if decisions:
        stats = routing_stats(decisions)
        headers, cells = tables.routing_table(stats)
        parts.append(htmlpage.table(headers, cells, cls="routing"))
        if plots.route_share(stats, out / "route_share.png"):
            parts.append(
                htmlpage.figure("route_share.png", "Per-instance share of routed requests")
            )
        if plots.kv_hit_rate(decisions, out / "kv_hit_rate.png"):
            parts.append(htmlpage.figure("kv_hit_rate.png", "KV cache hit rate over time"))
        if plots.predicted_vs_actual(decisions, out / "predicted_vs_actual.png"):
            parts.append(
                htmlpage.figure(
                    "predicted_vs_actual.png", "Router-predicted vs engine-reported cached tokens"
                )
            )
    return parts


def _meta(records: Sequence[StartRecord], decisions: int) -> str:
    span = ""
    if records:
        first = min(r.scheduled for r in records)
        last = max(r.scheduled for r in records)
        span = (
            f" covering {tables.seconds(last - first) if last > first else 'one instant'} from "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(first))} UTC"
        )
    return (
        f"{len(records)} start records{span}; "
        f"{decisions} routing decisions. Generated "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC."
    )


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
    records = list(events)
    decisions = [] if route_decisions_path is None else read_decisions(route_decisions_path)
    parts = _starts(records, out)
    if inventory:
        parts += _inventory(inventory, out)
    parts += _routing(routing_summary, decisions, out)
    page = htmlpage.page(title=title, meta=_meta(records, len(decisions)), body=parts)
    index = out / "index.html"
    tmp = out / ".index.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, index)
    return index
