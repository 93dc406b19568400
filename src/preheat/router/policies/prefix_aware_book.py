"""The per-instance bookkeeping of ``prefix_aware`` (router/policies/prefix_aware.py).

``PrefixAwareBook`` is the base class of ``PrefixAwarePolicy``: it keeps, by position in
the caller's instance list, each instance's rendezvous seed and decayed recent request
count, the positions ordered by that count (read by ``learned``), and the capacity
weights' staleness (read by ``stable``), and it realigns them when the list changes. The
placements' own state (the learned index, replica sets, home keys) stays in the policy.

Decayed counts: each count shrinks by (1 - 1/``balance_window``) per decision; the unit
``_g`` grows instead, which keeps a decision O(1), and every count is divided by it once
it passes 1e12. Counts of instances that leave the list are kept by id (``_recent``) and
come back with them.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator, Sequence
from typing import Any

from preheat.router.kvindex import CapacityIndex
from preheat.router.policies.base import BasePolicy, InstT, PolicyParams
from preheat.router.prefix import PrefixHasher

#: Marks a ``stable`` decision's state (router/policies/stable.py).
STABLE_STATE = "stable"


class InFlight:
    """The instances' in-flight counts by position, read when asked (``stable`` reads
    only its pick's unless it spills)."""

    __slots__ = ("_inst",)

    def __init__(self, instances: Sequence[Any]) -> None:
        self._inst = instances

    def __getitem__(self, j: int, /) -> int:
        return int(self._inst[j].in_flight)

    def __len__(self) -> int:
        return len(self._inst)

    def __iter__(self) -> Iterator[int]:
        return (i.in_flight for i in self._inst)


class PrefixAwareBook(BasePolicy[InstT]):
    """Seeds, positions, decayed recent counts and their order, per instance."""

    def __init__(self, params: PolicyParams, hasher: PrefixHasher, index: CapacityIndex) -> None:
        self.params = params
        self.hasher = hasher
        self.index = index
        # Capacity-weighted rendezvous weights for ``stable`` (None: all equal); rebuilt
        # when the instance list or a capacity changes.
        self._weights: list[float] | None = None
        self._weights_ok = False
        self._ids: list[str] = []
        self._seed_list: list[int] = []
        self._pos: dict[str, int] = {}
        self._recent: dict[str, float] = {}
        self._rl: list[float] = []
        # Positions into ``_rl`` by ascending recent count, equal counts in the order they
        # last grew (the untouched by position): the least-loaded instance under the
        # in-flight bound is the first of them below it. Only ``learned`` reads it, so it
        # is kept up to date only under ``learned`` and sorted again when read stale.
        self._order: list[int] = []
        self._order_ok = True
        # Per position: the decision at which its count last grew (-1: not since _sync).
        self._grew: list[int] = []
        self._tick = 0
        self._last: Sequence[InstT] | None = None
        self._g = 1.0

    def _sync(self, instances: Sequence[InstT]) -> None:
        """Align seeds, positions and recent counts with the caller's instance list.

        The same list object with the same ends is taken as unchanged (the proxy and the
        simulator build a new list when membership changes); anything else is compared
        id by id.
        """
        ids0 = self._ids
        if (
            instances is self._last
            and len(instances) == len(ids0)
            and instances[0].id == ids0[0]
            and instances[-1].id == ids0[-1]
        ):
            return
        ids = [i.id for i in instances]
        self._last = instances
        if ids != ids0:
            for x, c in zip(ids0, self._rl, strict=True):
                self._recent[x] = c
            seed = self.hasher.seed
            self._ids = ids
            self._seed_list = [seed(x) for x in ids]
            self._pos = {x: j for j, x in enumerate(ids)}
            self._rl = [self._recent.get(x, 0.0) for x in ids]
            self._order = sorted(range(len(ids)), key=self._rl.__getitem__)
            self._order_ok = True
            self._grew = [-1] * len(ids)
            self._weights_ok = False

    def _count_sent(self, iid: str) -> None:
        """Count one request sent to ``iid`` in the decayed recent counts."""
        g = self._g = self._g / (1.0 - 1.0 / self.params.balance_window)
        j = self._pos.get(iid)
        if j is not None and j < len(self._ids) and self._ids[j] == iid:
            rl = self._rl
            rl[j] += g
            self._grew[j] = self._tick
            self._tick += 1
            if self._order_ok and self.params.placement == "learned":
                order = self._order
                order.remove(j)
                insort(order, j, key=rl.__getitem__)
            else:
                self._order_ok = False
        else:
            self._recent[iid] = self._recent.get(iid, 0.0) + g
        if g > 1e12:
            # Dividing can make two counts equal: fix the order first, as it was, and
            # stamp it so a later sort keeps it.
            order = self._ordered()
            grew = self._grew
            for r, j in enumerate(order):
                grew[j] = r - len(order)
            self._rl = [c / g for c in self._rl]
            for k in self._recent:
                self._recent[k] /= g
            self._rescaled(g)
            self._g = 1.0

    def _rescaled(self, g: float) -> None:
        """Called when every count was divided by ``g``: divide what else grows with it."""
        return None

    def _ordered(self) -> list[int]:
        """``_order``, sorted again if decisions were made without keeping it: by count,
        then when it last grew, then position, which is the order ``insort`` keeps."""
        if not self._order_ok:
            rl, grew = self._rl, self._grew
            self._order = sorted(range(len(rl)), key=lambda j: (rl[j], grew[j], j))
            self._order_ok = True
        return self._order

    def set_capacity(self, instance_id: str, tokens: int | None) -> None:
        if self.index.capacity(instance_id) != tokens:
            self._weights_ok = False
        self.index.set_capacity(instance_id, tokens)

    def forget(self, instance_id: str) -> None:
        self._weights_ok = False
        for x, c in zip(self._ids, self._rl, strict=True):
            self._recent[x] = c
        self._recent.pop(instance_id, None)
        self._ids = []
        self._rl = []
        self._last = None
