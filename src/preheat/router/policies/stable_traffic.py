"""Traffic counts per prompt block and the spreads of hot blocks, for the ``stable``
placement (router/policies/stable.py, steps 1 and 3 of its header; pure).

1. **Traffic counts.** Every block hash of every routed request is counted, decayed by
   ``1 - 1/balance_window`` per request. A block's **share** is its count over
   ``max(total, LOAD_FLOOR * n)``: the part of recent requests whose prompt starts with
   that block. Counts depend on the request stream only (not on a decision or a load),
   so replicas that see the same requests in a slightly different order hold nearly the
   same counts. A block counted in every request so far (at least two: a shared
   system prompt) is as hot as the fleet at once, so it never holds a stream's first
   conversations or documents on the instance its first request went to.
3. **Spread with hysteresis.** ``t = HOT_SPREAD * share * n`` is how many instances the
   block's traffic fills to ``1 / HOT_SPREAD`` of a fair share each. ``k`` moves only in
   powers of two (1, 2, 4, ... then n): up to the smallest power >= ``t`` when ``t``
   exceeds ``k``, down only when ``(1 + HYSTERESIS) * t`` fits a smaller power. Few
   transitions, each at a count replicas reach within a few requests of each other.

Counts are kept in a growing unit ``g`` (a new count weighs ``g``, which grows by
``1 / (1 - 1/balance_window)`` per request): decaying every count is then O(1). The
unit is reset (every count divided) past 1e12.

Thresholds:

* ``HOT_SPREAD`` = 1.5: a hot block's members get at most about 2/3 of a fair share each
  from it (2 cost hit rate under KV pressure, 1 balance; docs/benchmarks.md, Router 7).
* ``HYSTERESIS`` = 0.5.
* ``LOAD_FLOOR`` = 10 requests per instance: early shares are taken over at least this
  many requests, so the first requests do not look hot.
* ``SPLIT_TARGET`` = 0.5, ``OVERLOAD`` = 0.05: ``stable-split`` only
  (router/policies/stable_split.py); a block it split keeps its spread while
  ``(1 + HYSTERESIS) * t >= SPLIT_TARGET``.
* ``max_entries`` (the caller's: a quarter of ``index_entries``, at least 1,000): the
  block counts kept (LRU); hot blocks are kept only while counted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from itertools import chain
from typing import Any

from preheat.router.prefix import PrefixKey

__all__ = [
    "HOT_SPREAD",
    "HYSTERESIS",
    "LOAD_FLOOR",
    "OVERLOAD",
    "SPLIT_TARGET",
    "BlockTraffic",
    "spread_for",
]

HOT_SPREAD = 1.5
HYSTERESIS = 0.5
SPLIT_TARGET = 0.5
OVERLOAD = 0.05
LOAD_FLOOR = 10.0
_UP = 1.0 + HYSTERESIS


def _pow2_at_least(t: float, n: int) -> int:
    """The smallest power of two >= t, capped at n (n itself once a power exceeds it)."""
    k = 1
    while k < t:
        k *= 2
    return min(k, n)


def spread_for(k: int, t: float, n: int) -> int:
    """The next spread of a block holding ``k`` with target ``t`` (module header, 3)."""
    k = min(max(k, 1), n)
    if t > k:
        return _pow2_at_least(t, n)
    down = _pow2_at_least(t * (1.0 + HYSTERESIS), n)
    return down if down < k else k


class BlockTraffic:
    """Decayed block counts, and the hot blocks with their spreads and members."""

    def __init__(self, max_entries: int, window: int) -> None:
        self.max_entries = max_entries
        self._decay = 1.0 - 1.0 / window
        # block -> decayed count (in units of g); insertion order is the LRU.
        self._counts: OrderedDict[int, float] = OrderedDict()
        # Hot blocks only (spread > 1): block -> [spread, members kept (instance ids)].
        # The decision (stable.py) reads it and writes the members.
        self.hot: dict[int, list[Any]] = {}
        self._total = 0.0
        self.g = 1.0

    def count(self, pk: PrefixKey, n: int, window: int | None = None) -> float | None:
        """Count the request's blocks and update their spreads (module header, 1 and 3);
        ``window`` (decisions) replaces the decay given at construction. Returns the
        factor every count was divided by when the unit was reset (else None): counts
        kept elsewhere in the same unit must be divided by it too."""
        if window is not None:
            self._decay = 1.0 - 1.0 / window
        g = self.g = self.g / self._decay
        total = self._total = self._total + g
        counts = self._counts
        get, to_end = counts.get, counts.move_to_end
        hot = self.hot
        hget = hot.get
        fleet = HOT_SPREAD * n
        scale = fleet / max(total, LOAD_FLOOR * n * g)
        g2 = 2 * g
        for h in pk.chain:
            c = get(h)
            if c is None:
                c = counts[h] = g
            else:
                c = counts[h] = c + g
                to_end(h)
            # In every request so far (a shared system prompt): as hot as the fleet.
            t = fleet if c >= total and c >= g2 else c * scale
            e = hget(h)
            if e is None:
                if t <= 1:
                    continue
                k = 1
            else:
                k = e[0]
                # spread_for keeps k (<= n) while t <= k and (1 + HYSTERESIS) * t exceeds
                # the largest power of two below k: then there is nothing to update.
                if k <= n and t <= k and t * _UP > 1 << ((k - 1).bit_length() - 1):
                    continue
            k2 = spread_for(k, t, n)
            if e is not None and len(e) > 2 and t * _UP >= SPLIT_TARGET:
                # Grown because its members were overloaded (``grow``): not below that.
                k2 = max(k2, min(e[2], n))
            if k2 == 1:
                hot.pop(h, None)
            elif e is None:
                hot[h] = [k2, ()]
            else:
                e[0] = k2
        while len(counts) > self.max_entries:
            h, _ = counts.popitem(last=False)
            hot.pop(h, None)
        if g > 1e12:
            for h in counts:
                counts[h] /= g
            self._total /= g
            self.g = 1.0
            return g
        return None

    def target(self, h: int, n: int) -> float:
        """``t`` of the module header for a block (0 when it is not counted)."""
        c = self._counts.get(h)
        if c is None:
            return 0.0
        return HOT_SPREAD * n * c / max(self._total, LOAD_FLOOR * n * self.g)

    def grow(self, h: int, members: tuple[str, ...], k: int) -> list[Any]:
        """Make ``h`` hot with spread ``k`` (at least that while its target stays at or
        above ``SPLIT_TARGET``), keeping ``members``; returns its entry."""
        e = self.hot.get(h)
        if e is None:
            e = self.hot[h] = [k, members, k]
        else:
            e[0] = k
            if len(e) > 2:
                e[2] = k
            else:
                e.append(k)
        return e

    def spread(self, h: int) -> int:
        """The spread kept for a block (1 when it is not hot)."""
        e = self.hot.get(h)
        return int(e[0]) if e is not None else 1

    def memberships(self, pos: Mapping[str, int], n: int, skip: int) -> list[int]:
        """How many hot sets smaller than the fleet each instance is a member of."""
        # Counted by id in C (Counter over the sets' tuples), then the skipped set taken
        # out: the same integers as counting set by set, without a Python step per member.
        counts = Counter(chain.from_iterable([e[1] for e in self.hot.values() if e[0] < n]))
        e = self.hot.get(skip)
        if e is not None and e[0] < n:
            counts.subtract(e[1])
        busy = [0] * n
        for x, c in counts.items():
            j = pos.get(x)
            if j is not None:
                busy[j] += c
        return busy
