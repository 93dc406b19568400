"""What an HTTP server and the proxy logic exchange: the parsed request and the answer.

``Incoming`` is a proxied request as a server parsed it; ``Sink`` is how the proxy
answers it (one ``reply``, or a stream). The raw-protocol front (``front.py``) and the
aiohttp adapter (``proxy_web.py``) each implement ``Sink``; ``proxy.Proxy.handle``
works with either. Error bodies are in the OpenAI format.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import orjson

HINT_HEADER = "X-Preheat-Prefix-Id"
#: Request headers never forwarded to an instance (hop-by-hop, or set by the router).
HOP = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "accept-encoding",
        "expect",
        "x-request-id",
    }
)
ERROR_CTYPE = "application/json; charset=utf-8"
#: Response headers of an instance not passed on to the client: hop-by-hop (RFC 9110
#: 7.6.1), the framing (the server frames the answer itself), ``Date`` (the router's
#: own) and the two the router sets. Every other header is passed, repeats kept.
RESP_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "date",
        "x-preheat-instance",
        "x-preheat-outcome",
    }
)


def passed_headers(pairs: Iterable[tuple[str, str]]) -> str:
    """An instance's response headers ``(name, value)`` as the ``Name: value\\r\\n``
    lines passed on to the client: every value of a repeated header (``Set-Cookie``,
    ``Vary``, ``Link``) in order, ``RESP_DROP`` and the names ``Connection`` lists left
    out."""
    pairs = list(pairs)
    drop = RESP_DROP
    for k, v in pairs:
        if k.lower() == "connection":
            drop = drop | {t.strip().lower() for t in v.split(",")}
    return "".join(f"{k}: {v}\r\n" for k, v in pairs if k.lower() not in drop)


def error_body(status: int, message: str, kind: str) -> bytes:
    """An error body in the OpenAI format: {"error": {"message", "type", "code"}}."""
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}})


def too_large_message(limit: int) -> str:
    return f"request body is over the router's limit of {limit} bytes"


@dataclass(slots=True)
class Incoming:
    """A proxied request as the server parsed it: the path (``/v1/...``), the body bytes,
    the three headers the router reads, and the forwarded headers as one block of
    ``\\r\\nName: value`` lines (``HOP`` headers left out)."""

    path: str
    raw: bytes
    variant: str | None
    request_id: str | None
    hint: str | None
    headers: bytes


class Sink(Protocol):
    """Where a handler answers: one ``reply``, or ``start`` + ``write``... + ``end``.
    ``passed`` is the instance's own headers (``passed_headers``), sent before
    ``headers``, the router's."""

    def reply(self, status: int, headers: dict[str, str], body: bytes, passed: str = "") -> None:
        """Answer at once with a whole body."""

    async def start(self, status: int, headers: dict[str, str], passed: str = "") -> None:
        """Send the head of a streamed answer."""

    async def write(self, chunk: bytes) -> None:
        """Send one piece now; ``ConnectionError`` once the client has gone."""

    async def end(self) -> None: ...


def reply_error(
    out: Sink, status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> None:
    """Answer ``out`` with an OpenAI-format error."""
    body = error_body(status, message, kind)
    out.reply(status, {**(headers or {}), "Content-Type": ERROR_CTYPE}, body)
