"""What an HTTP server and the proxy logic exchange: the parsed request and the answer.

``Incoming`` is a proxied request as a server parsed it; ``Sink`` is how the proxy
answers it (one ``reply``, or a stream). The raw-protocol front (``front.py``) and the
aiohttp adapter (``proxy_web.py``) each implement ``Sink``; ``proxy.Proxy.handle``
works with either. Error bodies are in the OpenAI format.
"""

from __future__ import annotations

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
    """Where a handler answers: one ``reply``, or ``start`` + ``write``... + ``end``."""

    def reply(self, status: int, headers: dict[str, str], body: bytes) -> None: ...

    async def start(self, status: int, headers: dict[str, str]) -> None: ...

    async def write(self, chunk: bytes) -> None:
        """Send one piece now; ``ConnectionError`` once the client has gone."""

    async def end(self) -> None: ...


def reply_error(
    out: Sink, status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> None:
    """Answer ``out`` with an OpenAI-format error."""
    body = error_body(status, message, kind)
    out.reply(status, {**(headers or {}), "Content-Type": ERROR_CTYPE}, body)
