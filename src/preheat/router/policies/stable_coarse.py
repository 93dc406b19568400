"""Coarse balance load for the ``stable-coarse`` placement: the load the balance weights
read is a snapshot taken every ``EPOCH`` first requests, rounded to ``QUANTUM`` requests,
so that replicas which count a request or two in a different order read the same load
(router/policies/stable.py, step 4; pure).

``stable``'s weights read the load at every decision, and a one-request difference
between replicas turns into a different weighted pick at about one cold decision in
twenty (gain 20 over a floor of 30); the divergent pick then moves later loads. Here:

* **Epochs.** The load is snapshotted when the count of non-extension requests (those
  ``SessionLoad`` counts: a chat's later turns are not, they arrive at each replica's
  own moment) reaches a multiple of ``EPOCH``; every decision until the next snapshot
  reads it. Replicas that see the same requests within an epoch in another order read
  the same snapshot; only a swap across an epoch boundary makes them differ.
* **Quantum.** Each snapshot load is rounded down to a multiple of ``QUANTUM`` requests
  (times the mean ``1 + r`` multiplier), so a one-request difference at a boundary
  changes it with probability about ``1 / QUANTUM``.

Thresholds: ``EPOCH`` (8 non-extension requests), ``QUANTUM`` (2 requests). Counts are
kept in request units and returned in the caller's unit ``g``.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import floor

from preheat.router.policies.stable_load import SessionLoad
from preheat.router.policies.stable_traffic import BlockTraffic
from preheat.router.prefix import PrefixKey

__all__ = ["EPOCH", "QUANTUM", "CoarseLoad"]

EPOCH = 8
QUANTUM = 2.0


class CoarseLoad:
    """``SessionLoad.loads`` read from a snapshot per epoch, rounded (module header)."""

    def __init__(self, load: SessionLoad, traffic: BlockTraffic) -> None:
        self.load = load
        self.traffic = traffic
        self._seen = 0
        # (ids the snapshot is of, loads in request units, mean, multiplier)
        self._snap: tuple[Sequence[str], list[float], float, float] | None = None
        self._ids: Sequence[str] | None = None

    def before_add(self, pk: PrefixKey) -> None:
        """Call before ``load.add`` of a request: at an epoch's end, snapshot the load."""
        if self.load.is_extension(pk):
            return
        self._seen += 1
        if self._seen % EPOCH == 0 and self._ids is not None:
            self._take(self._ids, self.traffic.g)

    def _take(self, ids: Sequence[str], g: float) -> None:
        loads, _, m = self.load.loads(ids)
        q = QUANTUM * m
        snap = [floor(v / g / q) * q for v in loads] if q > 0 else [v / g for v in loads]
        self._snap = (ids, snap, sum(snap) / len(snap) if snap else 0.0, m)

    def loads(
        self, ids: Sequence[str], only: Sequence[int] | None = None
    ) -> tuple[list[float], float, float]:
        """As ``SessionLoad.loads`` (in the traffic's unit ``g``), from the epoch's
        snapshot."""
        self._ids = ids
        g = self.traffic.g
        s = self._snap
        if s is None or (s[0] is not ids and list(s[0]) != list(ids)):
            self._take(ids, g)
            s = self._snap
            assert s is not None
        snap = s[1]
        loads = [v * g for v in snap] if only is None else [snap[j] * g for j in only]
        return loads, s[2] * g, s[3]

    def forget(self) -> None:
        """The fleet changed: the next read takes a fresh snapshot."""
        self._snap = None
