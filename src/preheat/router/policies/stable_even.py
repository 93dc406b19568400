"""Even placement counts for the ``stable-even`` placement: a cold prefix placed afresh
goes to the member of its set with the fewest prefixes placed afresh so far, ties by the
block's plain rendezvous score (router/policies/stable.py, step 4; pure).

``stable`` weighs a fresh placement by the replica's decayed request load (gain 20 over
a floor of 30): a one-request difference between replicas that saw two requests in the
other order turns into a different weighted pick, and the divergent pick then moves
every later load (divergence compounds: 77-99 % agreement over stream seeds when each
replica sees a slightly shuffled order). Counting placements instead of requests:

* **No compounding.** The least-count rule ("join the shortest queue" on counts) leaves
  the same count vector whatever order a run of fresh placements came in: two replicas
  that see prefixes a and b swapped may give them each other's instance, but the counts
  every later decision reads are the same again after both.
* **Balance.** Fresh placements are spread evenly (at most one apart per set), and each
  instance's count is over its KV capacity weight. What this does not see is how much
  traffic a placed prefix brings later (a long conversation, a hot file): that is left
  to the hot sets (stable_traffic.py, counts of the stream's content).
* **Joins.** An instance seen for the first time starts at the least count of the
  others, so it takes its share of new prefixes, not all of them until it catches up.

Counts are plain integers, kept per instance id (``forget`` drops one).
"""

from __future__ import annotations

from collections.abc import Sequence

from preheat.router.prefix import MASK64, SCORE_MULTIPLIER

__all__ = ["PlacementCounts"]

_MUL = SCORE_MULTIPLIER


class PlacementCounts:
    """Fresh placements per instance, and the least-count pick (module header)."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}

    def pick(
        self,
        h: int,
        seeds: Sequence[int],
        members: Sequence[int],
        ids: Sequence[str],
        capacity: Sequence[float] | None,
    ) -> int:
        """The member with the fewest placements (over its capacity weight), ties by
        the block's plain rendezvous score; counts the placement."""
        n = self._n
        if any(ids[j] not in n for j in members):
            start = min(n.values(), default=0)
            for j in members:
                n.setdefault(ids[j], start)

        def key(j: int) -> tuple[float, int]:
            c = n[ids[j]] + 1
            u = ((h ^ seeds[j]) * _MUL) & MASK64
            return (c / capacity[j] if capacity else float(c), -u)

        best = min(members, key=key)
        n[ids[best]] += 1
        return best

    def forget(self, instance_id: str) -> None:
        """An instance left: drop its count."""
        self._n.pop(instance_id, None)
