"""The discrete-event core: a virtual clock and a time-ordered event queue (pure).

Events are ``(time, seq, kind, payload)`` tuples in a binary heap; ``seq`` is a
monotonically increasing tie-breaker, so events at the same virtual time run in the
order they were scheduled and a run is deterministic (no comparison of payloads).
Time only moves when an event is popped; nothing here reads a real clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Any

__all__ = ["EventQueue"]


class EventQueue:
    """Pending events by virtual time; ``now`` is the time of the last event popped."""

    __slots__ = ("_heap", "_seq", "now", "popped")

    def __init__(self, start: float = 0.0) -> None:
        self._heap: list[tuple[float, int, Hashable, Any]] = []
        self._seq = 0
        self.now = start
        self.popped = 0

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, t: float, kind: Hashable, payload: Any = None) -> None:
        """Schedule ``kind`` at virtual time ``t`` (never before ``now``)."""
        if t < self.now:
            raise ValueError(f"event at t={t} is before now={self.now}; time only moves forward")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def after(self, dt: float, kind: Hashable, payload: Any = None) -> None:
        """Schedule ``kind`` ``dt`` seconds from now."""
        self.at(self.now + dt, kind, payload)

    def pop(self) -> tuple[float, Hashable, Any]:
        """The earliest event (FIFO among equal times); advances ``now`` to it."""
        t, _, kind, payload = heapq.heappop(self._heap)
        self.now = t
        self.popped += 1
        return t, kind, payload
