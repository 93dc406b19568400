"""The discrete-event core of both simulators: a virtual clock and a time-ordered queue (pure).

``preheat sim routing`` (one event per engine batch step, per arrival) and ``preheat sim
coldstart`` (samples, flows, starts, drains, interruptions) share this one queue.

Events are ``(time, seq, kind, payload)`` entries in a binary heap; ``seq`` is a
monotonically increasing tie-breaker, so events at the same virtual time run in the
order they were scheduled and a run is deterministic (payloads are never compared).
Time only moves when an event is popped; nothing here reads a real clock. Scheduling
before ``now`` is an error; ``after`` with a negative delay means "now". Cancelling is
by ignoring: a caller puts a generation number in the payload and drops stale events.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Any, NamedTuple

__all__ = ["Event", "EventQueue"]


class Event(NamedTuple):
    """A popped event: ``t, kind, payload = queue.pop()`` or ``ev.time`` / ``ev.kind``."""

    time: float
    kind: Hashable
    payload: Any


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
            raise ValueError(
                f"event {kind!r} at t={t} is before now={self.now}; time only moves forward"
            )
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def after(self, dt: float, kind: Hashable, payload: Any = None) -> None:
        """Schedule ``kind`` ``dt`` seconds from now (a negative ``dt`` means now)."""
        self.at(self.now + max(0.0, dt), kind, payload)

    def peek_time(self) -> float | None:
        """The time of the earliest pending event, or ``None`` when none is pending."""
        return self._heap[0][0] if self._heap else None

    def pop(self) -> Event:
        """The earliest event (FIFO among equal times); advances ``now`` to it."""
        t, _, kind, payload = heapq.heappop(self._heap)
        self.now = t
        self.popped += 1
        return Event(t, kind, payload)
