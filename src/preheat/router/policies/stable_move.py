"""Moves of heavy cold blocks for the ``stable-move`` placement: a cold block heavy
enough to matter whose instance is overloaded is re-homed once, to the first instance
of its plain rendezvous order at most at the mean load, instead of being copied
(router/policies/stable.py, the cold-block step; pure).

``stable`` never moves a placed prefix: two or three of the heaviest cold blocks (a
popular document, a repository's hottest files) can land on one instance in the first
requests and leave it 1.2-1.5x the mean share. ``stable-split`` copies such a block to a
second instance, and every copy costs KV memory for the rest of the run (0.006-0.017
hit rate). A move costs one prefill on the new home; the old copy ages out of the old
engine's LRU.

* **Trigger.** The block's target ``t`` (stable_traffic.py) is at least
  ``MOVE_TARGET``, and its instance carries more than ``OVERLOAD`` above the mean of
  the balance load (stable_load.py; the mean of the instances that carry any).
* **New home.** The block's plain rendezvous order in its set, the first instance at or
  below the mean load (none: it stays): a function of the block and the fleet, so
  replicas that move it move it to the same instance.
* **Once.** A moved block keeps its new home (``MAX_MOVED`` blocks, LRU) while that
  instance is in its set; an instance that leaves takes its moved blocks' homes with it
  (``forget``), so only what it held moves again.

Thresholds: ``MOVE_TARGET`` (0.5: a block with a third of a fair share), ``OVERLOAD``
(0.1 over ``max(mean, BALANCE_FLOOR)``: at 0.05 blocks moved on a few requests'
difference in the first requests and the code cells got worse; docs/benchmarks.md,
Router 7, "stable-move"), ``MAX_MOVED`` (4,096 moved blocks kept, LRU).

Measured (benchmarks/stable_load.py, 16 simulator runs): worst share 1.03 / 1.09 on the
RAG + chat cells (``stable``: 1.21 / 1.25) at the same hit rate (+0.001 / -0.002), and
1.14 / 1.33 on code completion (``stable``: 1.28 / 1.51) at -0.004 / -0.002 hit rate:
the code cells still miss the 1.10 bound (hot sets of a repository's hottest files
that share members, which a cold move does not touch). The default placement since
issue 14's movedefault (11 of 16 simulator runs and 15 of 16 live cells within 1.10,
``stable`` 5 and 11; docs/benchmarks.md, Router 7, "default switched"). Still open:
the code cells, and the load it reads is a function of decisions (shuffled-order
agreement 90-98 % on RAG and 91-97 % on templated over 6 stream seeds, ``stable``
93-100 % and 77-97 %; closed-loop streams and live c=8 100 %).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from preheat.router.policies.stable_load import SessionLoad
from preheat.router.policies.stable_traffic import BlockTraffic
from preheat.router.policies.stable_weights import BALANCE_FLOOR
from preheat.router.prefix import MASK64, SCORE_MULTIPLIER

__all__ = ["MAX_MOVED", "MOVE_TARGET", "OVERLOAD", "Moves"]

MOVE_TARGET = 0.5
OVERLOAD = 0.1
MAX_MOVED = 4096
_MUL = SCORE_MULTIPLIER


class Moves:
    """The blocks moved so far and their homes (module header)."""

    def __init__(self) -> None:
        self._home: OrderedDict[int, str] = OrderedDict()
        self.moves = 0

    def home(
        self,
        traffic: BlockTraffic,
        load: SessionLoad,
        h: int,
        j0: int,
        members: Sequence[int],
        ids: Sequence[str],
        pos: Mapping[str, int],
        seeds: Sequence[int],
    ) -> int:
        """Where cold block ``h``, held by position ``j0``, goes (``j0`` unless it moves
        or has moved)."""
        x = self._home.get(h)
        if x is not None:
            j = pos.get(x)
            if j is not None and j in members:
                return j
        n = len(ids)
        if traffic.target(h, n) < MOVE_TARGET:
            return j0
        loads, _, m = load.loads(ids)
        busy = [v for v in loads if v > 0.0]
        mean = sum(busy) / len(busy) if busy else 0.0
        floor = max(mean, BALANCE_FLOOR * traffic.g * m)
        if loads[j0] - mean <= OVERLOAD * floor:
            return j0
        # The first member of the plain rendezvous order (equal scores: members' order)
        # at or below the mean: the highest-scoring such member, found without a sort.
        low = [j for j in members if j != j0 and loads[j] <= mean]
        if not low:
            return j0
        j = max(low, key=lambda j: ((h ^ seeds[j]) * _MUL) & MASK64)
        self._home[h] = ids[j]
        if len(self._home) > MAX_MOVED:
            self._home.popitem(last=False)
        self.moves += 1
        return j

    def forget(self, instance_id: str) -> None:
        """An instance left: its moved blocks are placed afresh."""
        for b in [b for b, x in self._home.items() if x == instance_id]:
            del self._home[b]
