"""Requests that wait while a model's ready capacity is short: a bounded FIFO, as a fluid.

Pure. Demand in the cold-start simulator is requests in flight per model; by Little's
law that is an arrival rate ``lam = in_flight / request_seconds``. A model's ready
replicas serve ``ready x replica_in_flight`` requests at once, so they take new
requests at ``mu = ready x replica_in_flight / request_seconds`` per second. Both rates
are constant between simulator events, and the queue moves as a fluid between them:

- no queue and ``lam <= mu``: every request goes straight to a replica (waits 0);
- otherwise requests join the queue at ``lam`` and leave it for a replica at ``mu``
  (first in, first out); the queue grows at ``lam - mu`` or drains at ``mu - lam``;
- at ``max_queued`` waiting requests, arrivals beyond what leaves are dropped.

A request's wait is the time between its place in the queue being reached by the
arrivals and by the departures (both piecewise linear in time), so every queued request
has an exact wait. The distribution is kept as weighted points: each overlap of one
arrival piece with one departure piece (the wait is linear along it) adds up to
``_POINTS`` evenly spaced points, so a percentile is exact to within 1/16 of the wait's
change over one piece. Requests still waiting when the run ends are counted apart
(``queued_at_end``), not as waits.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["ModelQueue", "QueueSummary", "summarize_queues"]

_POINTS = 8  # points per overlap of an arrival piece with a departure piece
_EPS = 1e-9


@dataclass(frozen=True)
class QueueSummary:
    requests: float
    waited: float
    dropped: float
    queued_at_end: float
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float

    def to_dict(self) -> dict[str, float]:
        return {
            "requests": round(self.requests),
            "waited": round(self.waited),
            "dropped": round(self.dropped),
            "dropped_share": round(self.dropped / self.requests, 6) if self.requests else 0.0,
            "queued_at_end": round(self.queued_at_end),
            "wait_p50_s": round(self.wait_p50_s, 3),
            "wait_p99_s": round(self.wait_p99_s, 3),
            "wait_max_s": round(self.wait_max_s, 3),
        }


class ModelQueue:
    """One model's queue; ``set_rates`` between events, ``advance`` over each interval."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = float(max_queued)
        self.lam = 0.0
        self.mu = 0.0
        self.queued = 0.0
        self.arrived = 0.0
        self.direct = 0.0  # requests that never waited
        self.dropped = 0.0
        #: Queued arrivals not yet served: (first position, last position, t at first, t at last).
        self._pending: deque[tuple[float, float, float, float]] = deque()
        self._in = 0.0  # positions of queued arrivals so far
        self._out = 0.0  # positions served from the queue so far
        self.points: list[tuple[float, float]] = []  # (wait seconds, requests)

    def set_rates(self, lam: float, mu: float) -> None:
        self.lam = max(lam, 0.0)
        self.mu = max(mu, 0.0)

    def advance(self, t0: float, t1: float) -> None:
        t = t0
        while t1 - t > _EPS:
            lam, mu, q = self.lam, self.mu, self.queued
            if q <= _EPS and lam <= mu:
                self.queued = 0.0
                self.direct += lam * (t1 - t)
                self.arrived += lam * (t1 - t)
                return
            if q >= self.max_queued - _EPS and lam >= mu:
                # Full: what leaves is replaced by what arrives, the rest is dropped.
                end = t1
                if self.max_queued <= _EPS:
                    self.direct += mu * (end - t)
                else:
                    self._arrive(mu, t, end)
                    self._serve(mu, t, end)
                self.dropped += (lam - mu) * (end - t)
                self.arrived += lam * (end - t)
                return
            if lam > mu:
                end = min(t1, t + (self.max_queued - q) / (lam - mu))
            elif lam < mu:
                end = min(t1, t + q / (mu - lam))
            else:
                end = t1
            self._arrive(lam, t, end)
            self._serve(mu, t, end)
            self.arrived += lam * (end - t)
            self.queued = max(q + (lam - mu) * (end - t), 0.0)
            if lam > mu and end < t1:
                self.queued = self.max_queued
            elif lam < mu and end < t1:
                self.queued = 0.0
            t = end

    def _arrive(self, rate: float, t0: float, t1: float) -> None:
        n = rate * (t1 - t0)
        if n > _EPS:
            self._pending.append((self._in, self._in + n, t0, t1))
            self._in += n

    def _serve(self, rate: float, s0: float, s1: float) -> None:
        m = min(rate * (s1 - s0), self._in - self._out)
        if m <= _EPS:
            return
        d0, d1 = self._out, self._out + m
        self._out = d1
        while self._pending and d0 < d1 - _EPS:
            p0, p1, a0, a1 = self._pending[0]
            x0, x1 = max(p0, d0), min(p1, d1)
            if x1 > x0:
                self._points(x0, x1, (p0, p1, a0, a1), (d0, d1, s0, s1))
            if p1 <= d1 + _EPS:
                self._pending.popleft()
            else:
                break

    def _points(
        self,
        x0: float,
        x1: float,
        arr: tuple[float, float, float, float],
        dep: tuple[float, float, float, float],
    ) -> None:
        def at(seg: tuple[float, float, float, float], x: float) -> float:
            p0, p1, t0, t1 = seg
            return t0 if p1 - p0 <= _EPS else t0 + (x - p0) / (p1 - p0) * (t1 - t0)

        n = x1 - x0
        k = max(1, min(_POINTS, math.ceil(n)))
        for i in range(k):
            x = x0 + (i + 0.5) * n / k
            self.points.append((max(at(dep, x) - at(arr, x), 0.0), n / k))


def _weighted(points: list[tuple[float, float]], q: float) -> float:
    total = sum(w for _, w in points)
    if total <= 0:
        return 0.0
    goal = q * total
    run = 0.0
    for wait, w in points:
        run += w
        if run >= goal - _EPS:
            return wait
    return points[-1][0]


def summarize_queues(queues: dict[str, ModelQueue]) -> QueueSummary:
    """Fleet-wide figures: every request that arrived, waited, was dropped or still waits."""
    points: list[tuple[float, float]] = []
    direct = requests = dropped = left = 0.0
    for mq in queues.values():
        points.extend(mq.points)
        direct += mq.direct
        requests += mq.arrived
        dropped += mq.dropped
        left += mq.queued
    waited = sum(w for _, w in points)
    points.append((0.0, direct))
    points.sort()
    return QueueSummary(
        requests=requests,
        waited=waited,
        dropped=dropped,
        queued_at_end=left,
        wait_p50_s=_weighted(points, 0.50),
        wait_p99_s=_weighted(points, 0.99),
        wait_max_s=max((w for w, n in points if n > 0), default=0.0),
    )
