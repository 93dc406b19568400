"""The upstream client's errors (``router.upstream``).

``ConnectFailed``: the instance refused or is unreachable (it is down);
``Disconnected``: the connection closed before the response was complete (``reused``
says whether it was a pooled keep-alive connection, which the caller retries once on a
fresh one); ``BadResponse``: not an HTTP/1.x response.
"""

from __future__ import annotations

__all__ = ["BadResponse", "ConnectFailed", "Disconnected", "UpstreamError"]


class UpstreamError(Exception):
    """An upstream connection failed (see the subclasses)."""


class ConnectFailed(UpstreamError):
    """The instance refused the connection or cannot be reached."""


class Disconnected(UpstreamError):
    """The connection closed before the response was complete."""

    def __init__(self, message: str, *, reused: bool, started: bool) -> None:
        super().__init__(message)
        self.reused = reused
        self.started = started


class BadResponse(UpstreamError):
    """The instance sent something that is not an HTTP/1.x response."""
