"""Parse a request trace: JSONL, one request per line (pure; the caller reads the file).

A line is either an OpenAI request body (``/v1/chat/completions`` if it has
``messages``, else ``/v1/completions`` with a ``prompt``) or ``{"t": seconds, "body":
{...}}`` with an arrival time. Blank lines and lines starting with ``#`` are skipped.
Either every request has ``t`` (open loop, replayed at those times) or none has (closed
loop at ``--concurrency``). Errors name the line and what to fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from preheat.engine.core.chat import render_chat
from preheat.errors import ConfigError
from preheat.sim.routing import SimItem

__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "parse_trace"]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def parse_trace(lines: Iterable[str], *, where: str = "trace") -> list[SimItem]:
    """The trace's requests in file order, sorted by ``t`` when times are given."""
    out: list[SimItem] = []
    timed = None
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        at = f"{where}:{lineno}"
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{at}: not valid JSON ({exc}); one JSON object per line") from exc
        if not isinstance(doc, dict):
            raise ConfigError(f"{at}: a line must be a JSON object (a request body)")
        t = None
        if "body" in doc and ("t" in doc or set(doc) == {"body"}):
            t = doc.get("t")
            body = doc["body"]
            if t is not None and (
                isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0
            ):
                raise ConfigError(f"{at}: 't' must be seconds >= 0, got {t!r}")
            if not isinstance(body, dict):
                raise ConfigError(f"{at}: 'body' must be an OpenAI request object")
        else:
            body = doc
        if (t is not None) != (timed if timed is not None else t is not None):
            raise ConfigError(
                f"{at}: mixes lines with and without 't'; give every line a time or none"
            )
        timed = t is not None
        if "messages" in body:
            try:
                render_chat(body["messages"], body.get("tools"))
            except ConfigError as exc:
                raise ConfigError(f"{at}: {exc}") from exc
            path = CHAT_PATH
        elif "prompt" in body:
            path = COMPLETIONS_PATH
        else:
            raise ConfigError(f"{at}: the body has neither 'messages' nor 'prompt'")
        out.append(
            SimItem(f"trace-{lineno}", path, body, None, float(t) if t is not None else None)
        )
    if not out:
        raise ConfigError(f"{where}: no requests; give one JSON request body per line")
    if timed:
        out.sort(key=lambda it: it.t or 0.0)
    return out
