"""How one pull fetches: ``PullOptions`` and the progress callback's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preheat.errors import ConfigError
from preheat.store.fill import RateLimiter

__all__ = ["Progress", "PullOptions"]

# progress(done_bytes, total_bytes), called from the pull's event loop about 5 times a second.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PullOptions:
    """How one pull fetches (validated by ``check``)."""

    rate_limit: float | None
    connections: int
    progress: Progress | None
    chunk: int
    #: ``sources.peer.PeerFill`` (pieces from peers first) and the cluster-wide origin
    #: token bucket; both None for a plain origin pull.
    peers: Any = None
    origin_limiter: RateLimiter | None = None
    #: Snapshot digests this fill's eviction must not take (a warm-up sparing the warmed
    #: copies no replica has used yet, ``store.space``).
    spare: frozenset[str] = frozenset()

    def check(self) -> None:
        if self.connections < 1:
            raise ConfigError(f"connections {self.connections} must be >= 1")
        if self.chunk < 64 << 10:
            raise ConfigError(f"chunk size {self.chunk} is below 64 KiB; use e.g. 32MiB")
        if self.rate_limit is not None and self.rate_limit <= 0:
            raise ConfigError(f"rate_limit {self.rate_limit} must be > 0 bytes/s (or None)")
