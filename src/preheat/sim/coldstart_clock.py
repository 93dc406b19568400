"""A tiny discrete-event agenda for the cold-start simulator (pure: virtual time only).

Events are ``(time, kind, payload)``; ``pop`` returns the earliest, ties in the order
they were scheduled (a sequence number breaks them, so a run is repeatable). Time never
goes back: scheduling before ``now`` is an error. Cancelling is by ignoring: callers put
a generation number in the payload and drop events whose generation is stale.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Agenda", "Event"]


@dataclass(frozen=True, order=True)
class Event:
    time: float
    seq: int
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


class Agenda:
    """Future events in time order; ``now`` is the time of the last event popped."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[Event] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, time: float, kind: str, payload: Any = None) -> None:
        """Schedule ``kind`` at virtual ``time`` (not before ``now``)."""
        if time < self.now:
            raise ValueError(f"event {kind!r} at {time} is before now ({self.now})")
        self._seq += 1
        heapq.heappush(self._heap, Event(time, self._seq, kind, payload))

    def after(self, delay: float, kind: str, payload: Any = None) -> None:
        self.at(self.now + max(0.0, delay), kind, payload)

    def peek_time(self) -> float | None:
        return self._heap[0].time if self._heap else None

    def pop(self) -> Event:
        ev = heapq.heappop(self._heap)
        self.now = ev.time
        return ev
