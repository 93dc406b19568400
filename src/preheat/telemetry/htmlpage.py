"""HTML for the report: escaped tables, the stage matrix, figures and the page template.

Everything is escaped here and nowhere else; the page template (``report.html`` next to
this module) holds the only CSS and script, so the page loads nothing from elsewhere.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from importlib import resources
from string import Template

from preheat.telemetry.records import STAGES, EventClass
from preheat.telemetry.stats import READY, StageStats
from preheat.telemetry.tables import seconds

__all__ = ["escape", "figure", "page", "stage_matrix", "table"]


def escape(x: object) -> str:
    """``x`` as text safe inside HTML elements and quoted attributes."""
    return html.escape(str(x))


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "") -> str:
    """A table; cells that start with a number are right-aligned (``class="num"``)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for c in row:
            num = c[:1].isdigit() or (c.startswith("-") and c[1:2].isdigit())
            cells.append(f'<td class="num">{escape(c)}</td>' if num else f"<td>{escape(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    )


def stage_matrix(rows: Sequence[StageStats]) -> str:
    """Event classes down, stages (and ready) across, three rows per class: p50/p95/p99."""
    cells: dict[tuple[EventClass, str], StageStats] = {(r.event_class, r.stage): r for r in rows}
    stages = [s for s in (*STAGES, READY) if any(k[1] == s for k in cells)]
    classes = [c for c in EventClass if any(k[0] == c for k in cells)]
    head = "<th>event class</th><th>n</th><th></th>" + "".join(
        f"<th>{escape(s)}</th>" for s in stages
    )
    body = []
    for cls in classes:
        n = max(r.seconds.n for (c, _), r in cells.items() if c == cls)
        for q in ("p50", "p95", "p99"):
            lead = (
                f'<td rowspan="3">{escape(cls.value)}</td><td class="num" rowspan="3">{n}</td>'
                if q == "p50"
                else ""
            )
            tds = []
            for stage in stages:
                row = cells.get((cls, stage))
                val = "-" if row is None else seconds(getattr(row.seconds, q))
                tds.append(f'<td class="num">{escape(val)}</td>')
            body.append(
                f'<tr data-class="{escape(cls.value)}" data-q="{q}">{lead}<td>{q}</td>'
                f"{''.join(tds)}</tr>"
            )
    return (
        f'<table class="stages"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def figure(name: str, caption: str) -> str:
    """An image (a PNG next to the page, linked relatively) with its caption."""
    return (
        f'<figure><img src="{escape(name)}" alt="{escape(caption)}">'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def page(*, title: str, meta: str, body: Sequence[str]) -> str:
    """The whole page: the template with the title, the meta line and the sections."""
    template = Template(
        resources.files("preheat.telemetry").joinpath("report.html").read_text(encoding="utf-8")
    )
    return template.substitute(title=escape(title), meta=escape(meta), body="\n".join(body))
