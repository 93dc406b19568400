"""Injected time: a real clock for the live system, a virtual one for tests and the simulator."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Something that tells time in seconds. ``now()`` is monotonic; ``wall()`` is epoch time."""

    def now(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``time.time``."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class VirtualClock:
    """A clock that only moves when told to; used by tests and the simulator."""

    def __init__(self, start: float = 0.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._t = start
        self._wall_offset = wall_offset

    def now(self) -> float:
        return self._t

    def wall(self) -> float:
        return self._wall_offset + self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds} s")
        self._t += seconds

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"cannot move a clock backwards from {self._t} to {t}")
        self._t = t
