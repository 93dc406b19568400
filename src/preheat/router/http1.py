"""HTTP/1.1 response framing for the router's front: status lines, heads, chunks, dates.

The front (``front.py``) answers in one write per response where it can: the head is
built here as bytes (``head``), a non-streamed body follows it in the same write, a
streamed one goes out as chunked transfer coding (``chunk``, ``LAST_CHUNK``). The
``Date`` header is formatted once per second.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

#: Limits of a request head (aiohttp's own limits for a line and a header count).
MAX_LINE = 8190
MAX_HEADERS = 128
MAX_HEAD_BYTES = 65536

LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_REASONS = {s.value: s.phrase for s in HTTPStatus}
_STATUS_LINES: dict[int, str] = {}
_date_at = 0
_date = ""


def status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
    return line


def date() -> str:
    """The ``Date`` header value, formatted at most once a second."""
    global _date_at, _date
    now = int(time.time())
    if now != _date_at:
        _date_at = now
        _date = formatdate(now, usegmt=True)
    return _date


def head(
    status: int,
    headers: dict[str, str],
    *,
    length: int | None,
    keep_alive: bool,
    http10: bool = False,
    passed: str = "",
) -> bytes:
    """A response head: status line, ``passed`` (an instance's own header lines, as
    ``wire.passed_headers`` gives them), ``headers``, the framing (``Content-Length``
    when ``length`` is given, else chunked, or close-delimited for an HTTP/1.0 client),
    ``Date`` and the ``Connection`` header the client needs to know what comes next."""
    parts = [status_line(status), passed]
    for k, v in headers.items():
        parts.append(f"{k}: {v}\r\n")
    if length is not None:
        if status >= 200 and status not in (204, 304):
            parts.append(f"Content-Length: {length}\r\n")
    elif not http10:
        parts.append("Transfer-Encoding: chunked\r\n")
    parts.append(f"Date: {date()}\r\n")
    if not keep_alive:
        parts.append("Connection: close\r\n\r\n")
    elif http10:
        parts.append("Connection: keep-alive\r\n\r\n")
    else:
        parts.append("\r\n")
    return "".join(parts).encode("latin-1", "replace")


def chunk(data: bytes) -> bytes:
    """One piece of a chunked body (never empty: an empty chunk ends the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)
