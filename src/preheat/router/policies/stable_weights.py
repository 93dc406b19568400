"""Rendezvous weights of the ``stable`` placement: capacity and balance, used only where
nothing is placed yet (router/policies/stable.py, step 4 of its header; pure).

Instance j's weight is ``cap_j * exp(-BALANCE_GAIN * (load_j - mean) / max(mean,
BALANCE_FLOOR * m))``: ``cap_j`` its KV capacity over the largest (router/kvcapacity.py;
unknown: the mean of the known; all equal: 1), ``load_j`` the decayed requests sent to
it, a chat's later turns counted through its first (router/policies/stable_load.py),
``m`` the mean of ``1 + r`` there. Weighted rendezvous (``w / -ln(u)``) places a cold
prefix on the instance with the least recent traffic, one copy each: the working set is
partitioned over the fleet's aggregate KV memory.

Thresholds:

* ``BALANCE_GAIN`` = 20 over ``BALANCE_FLOOR`` = 30 requests per instance: an instance
  10 % above the mean load weighs e^-2 as much for new prefixes, and while the mean is
  below 30 requests a one-request difference changes a weight by at most e^(20/30)
  (gain 10 over a floor of 10 let the first requests' order decide; gain 10 over 100
  left RAG documents 1.35x the mean; 20 over 30 was the best pair tried in process
  for agreement and share together). The KV-write term of an earlier version (gain
  1) is gone: with this load it moved hit rate and share by less than run-to-run noise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import exp, log

from preheat.router.kvindex import CapacityIndex
from preheat.router.policies.stable_load import SessionLoad
from preheat.router.prefix import MASK64, SCORE_MULTIPLIER

__all__ = [
    "BALANCE_FLOOR",
    "BALANCE_GAIN",
    "FleetWeights",
    "balance_weights",
    "capacity_weights",
    "rendezvous_best",
    "rendezvous_scores",
]

BALANCE_GAIN = 20.0
BALANCE_FLOOR = 30.0
_MUL = SCORE_MULTIPLIER
_TWO64 = float(1 << 64)
# A skipped instance's score bound must beat the best by more than a few rounding steps.
_MARGIN = 1.0 + 1e-9
_SLACK = 1.0 - 1e-6


def capacity_weights(ids: Sequence[str], index: CapacityIndex) -> list[float] | None:
    """Rendezvous weights from the capacities learned (None: all equal; module header)."""
    caps = [index.capacity(x) for x in ids]
    known = [c for c in caps if c is not None]
    if not known or (len(known) == len(caps) and min(known) == max(known)):
        return None
    top = max(known)
    fill = sum(known) / len(known)
    w = [(c if c is not None else fill) / top for c in caps]
    return None if min(w) == max(w) else w


class FleetWeights(Sequence[float]):
    """The weights ``balance_weights`` gives (of ``only``'s positions, in that order, or
    of every instance), each computed when read: a weighted rendezvous pick reads the
    few whose score can win (``bound``), not all of them. A weight read is the same
    float a list of them holds."""

    __slots__ = ("_base", "_list", "_loads", "_mean", "_neg")

    def __init__(
        self, base: Sequence[float] | None, loads: list[float], mean: float, norm: float
    ) -> None:
        self._base = base
        self._loads = loads
        self._mean = mean
        self._neg = -norm
        self._list: list[float] | None = None

    def __len__(self) -> int:
        return len(self._loads)

    def __getitem__(self, j: int) -> float:  # type: ignore[override]
        w = exp(self._neg * (self._loads[j] - self._mean))
        return self._base[j] * w if self._base is not None else w

    def __iter__(self) -> Iterator[float]:
        return iter(self.materialize())

    def materialize(self) -> list[float]:
        """All the weights, in position order (computed once)."""
        if self._list is None:
            neg, mean = self._neg, self._mean
            if self._base is None:
                self._list = [exp(neg * (c - mean)) for c in self._loads]
            else:
                self._list = [
                    w * exp(neg * (c - mean)) for w, c in zip(self._base, self._loads, strict=True)
                ]
        return self._list

    def bound(self) -> float:
        """At least every weight (the largest capacity at the least load): a pick may
        skip an instance whose score with this weight cannot beat the best so far."""
        top = max(self._base) if self._base is not None else 1.0
        return top * exp(self._neg * (min(self._loads) - self._mean))


def balance_weights(
    load: SessionLoad,
    ids: Sequence[str],
    capacity: Sequence[float] | None,
    g: float,
    only: Sequence[int] | None = None,
) -> Sequence[float] | None:
    """Capacity weights times the balance term (module header) of the positions ``only``,
    in that order (None: every instance), read lazily (``FleetWeights``); ``g`` is the
    unit ``load`` counts in."""
    n = len(ids)
    if n == 0:
        return None
    loads, mean, m = load.loads(ids, only)
    norm = BALANCE_GAIN / max(mean, BALANCE_FLOOR * g * m)
    if not capacity:
        return FleetWeights(None, loads, mean, norm)
    return FleetWeights(
        capacity if only is None else [capacity[j] for j in only], loads, mean, norm
    )


def rendezvous_best(
    h: int, seeds: Sequence[int], members: list[int], w: Sequence[float] | None
) -> int:
    """The member with the highest (weighted) rendezvous score of ``h``; ``w`` holds
    the members' weights in order (None: all equal). The first of equal scores wins,
    as ``max`` does."""
    if w is None:
        return max(members, key=lambda j: ((h ^ seeds[j]) * _MUL) & MASK64)
    if type(w) is FleetWeights:
        # Score the member of the highest plain score first; a member can beat it
        # only if the largest weight over its divisor can, i.e. only if its plain
        # score is at least ``least`` (kept low by a margin): score just those.
        us = [((h ^ seeds[j]) * _MUL) & MASK64 for j in members]
        i0 = us.index(max(us))
        best = w[i0] / -log((us[i0] + 0.5) / _TWO64)
        top = w.bound() * _MARGIN
        least = int(_TWO64 * exp(-top / best) * _SLACK) if best > 0.0 else 0
        bi = i0
        for i, u in enumerate(us):
            if u >= least and i != i0:
                s = w[i] / -log((u + 0.5) / _TWO64)
                if s > best or (s == best and i < bi):
                    best, bi = s, i
        return members[bi]
    sc = [
        wj / -log((((h ^ seeds[j]) * _MUL & MASK64) + 0.5) / _TWO64)
        for j, wj in zip(members, w, strict=True)
    ]
    return members[sc.index(max(sc))]


def rendezvous_scores(h: int, seeds: Sequence[int], weights: Sequence[float] | None) -> list[float]:
    if weights is None:
        return [float(((h ^ s) * _MUL) & MASK64) for s in seeds]
    # Weighted rendezvous (Schindelhauer & Schomaker): w / -ln(u), u uniform in (0, 1).
    return [
        w / -log((((h ^ s) * _MUL & MASK64) + 0.5) / _TWO64)
        for s, w in zip(seeds, weights, strict=True)
    ]
