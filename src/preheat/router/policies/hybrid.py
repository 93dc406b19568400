"""``placement: hybrid`` and ``placement: hash`` of ``prefix_aware``: placements that read
no in-flight count below ``concurrency_threshold`` (pure).

``hash`` skips every step of the other placements but the hard cap: the first instance
in rendezvous order of the key below ``concurrency_threshold`` wins (SageMaker's rule).
It keeps no state and reads no relative load, so replicas agree whatever order they see
requests in, at the cost of balance (a hot prefix stays on one instance until the cap)
and of prompts that outgrow ``prefix_length``.

``hybrid`` places nothing by "least loaded":

a. **Home key**: the chain hash at the first cut at least ``HOME_CHARS`` (1,024) into
   the first turn (the first message that is not a system/developer message, or the
   whole completion prompt), or at that turn's end if it is shorter: a conversation's
   first user turn (every later turn repeats it), a RAG document's first block, a
   template's first block.
b. **Hot homes own k instances**: with ``s`` the home's share of recent requests
   (decayed per decision by ``1 - 1/balance_window``), it owns the top ``k = ceil(
   HOT_SPREAD * s * n)`` (``HOT_SPREAD`` = 2) of its rendezvous order; a request picks
   among them by its own key's rendezvous score. ``s`` comes from the request stream
   alone.
c. **Follow**: if the learned index knows a block at or past the home block (or the
   end of the first turn: a chat's earlier turn), its holders (with the hot top k)
   come first, ties by the request key; a conversation that once moved stays moved.
d. **Share bound, spill along the home's order**: the first candidate whose recent
   count is below ``mean + WARM_MARGIN * balance_epsilon * max(mean, LOAD_FLOOR)``
   (``WARM_MARGIN`` = 0.8: the bound is on decayed counts) takes it; a cold home
   (never seen) uses ``mean + 1`` instead, since it loses nothing by moving, so cold
   traffic does the balancing. Then any instance under ``concurrency_threshold``, then
   the least loaded (``fallback``).

Replicas agree whatever in-flight counts they see (every input is the stream and the
decisions made on it); they diverge only when they see requests in a different order
near a share-bound decision, and a diverged decision shifts later counts, so divergence
compounds: in process, 1 % of adjacent RAG requests swapped leaves 85 % agreement.
Measured (docs/benchmarks.md, Router 3-4): 4 router processes agree on 100 % of RAG and
90-100 % of templated requests at concurrency 8 but only 38-43 % of multi-turn chat (a
turn waits for its previous answer, so replicas see turns in different orders and a
conversation's first turn decides all its turns).

``LOAD_FLOOR`` = 10 requests: shares are taken over at least this many per instance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import ceil

from preheat.router.kvindex import CapacityIndex
from preheat.router.policies.base import Choice, InstT
from preheat.router.prefix import CHARS_PER_TOKEN, MASK64, SCORE_MULTIPLIER, PrefixKey

__all__ = [
    "HOME_CHARS",
    "HOT_SPREAD",
    "WARM_MARGIN",
    "HybridPlacement",
    "choose_hashed",
    "home_block",
    "scores",
]

_MUL = SCORE_MULTIPLIER
LOAD_FLOOR = 10.0
# The home key is the first cut at least this far into the first turn.
HOME_CHARS = 1024
# A home with request share s owns the top ceil(HOT_SPREAD * s * n) instances.
HOT_SPREAD = 2.0
# A known prefix may exceed the mean by this part of ``balance_epsilon`` (the bound is
# on decayed counts; the margin keeps plain shares within 1 + epsilon).
WARM_MARGIN = 0.8


def home_block(pk: PrefixKey, fstart: int, fend: int) -> int:
    """The home block: the first cut at least ``HOME_CHARS`` into the first turn (or that
    turn's end if it is shorter); the last block for a hinted or one-block key."""
    hd = len(pk.chain) - 1
    if not pk.hinted and hd > 0:
        t = min(fstart + HOME_CHARS, fend)
        for i, c in enumerate(pk.cuts):
            if c >= t:
                return i
    return hd


def scores(key: int, seeds: list[int]) -> list[int]:
    """Plain rendezvous scores of ``key`` (prefix.score inlined: the hot path at 64)."""
    return [((key ^ s) * _MUL) & MASK64 for s in seeds]


def choose_hashed(
    pk: PrefixKey, instances: Sequence[InstT], loads: list[int], seeds: list[int], limit: int
) -> Choice[InstT]:
    """``placement: hash``: rendezvous order of the key, skipping instances at ``limit``
    in flight (SageMaker's spill rule); no learned state and no relative load bound, so
    replicas agree whatever order they see requests in."""
    n = len(instances)
    sc = scores(pk.key, seeds)
    eligible = [s if x < limit else -1 for s, x in zip(sc, loads, strict=True)]
    best = max(eligible)
    if best >= 0:
        pick = eligible.index(best)
        rank = sum(1 for s in sc if s > best)
        outcome = ("hint" if pk.hinted else "affinity") if rank == 0 else "spill"
    else:
        pick = max(range(n), key=lambda j: (-loads[j], sc[j]))
        rank = sum(1 for s in sc if s > sc[pick])
        outcome = "fallback"
    return Choice(
        instance=instances[pick],
        outcome=outcome,
        rank=rank,
        prefix_blocks=len(pk.chain),
        predicted_cached_tokens=0,
        prompt_chars=pk.prompt_chars,
        state=None,
    )


class HybridPlacement:
    """Decayed request counts per home key, and the decision of the module header."""

    def __init__(self, index: CapacityIndex, max_homes: int) -> None:
        self.index = index
        self.max_homes = max_homes
        # Decayed request counts per home key (an insertion-ordered dict as an LRU).
        self._homes: dict[int, float] = {}

    def choose(
        self,
        pk: PrefixKey,
        fstart: int,
        fend: int,
        instances: Sequence[InstT],
        loads: list[int],
        seeds: list[int],
        *,
        recent: Sequence[float],
        g: float,
        pos: Mapping[str, int],
        epsilon: float,
        limit: int,
    ) -> Choice[InstT]:
        """The rendezvous order of a stable home key, a hot home spread over the top
        ``k`` of its order, the share bound, spill along the order (module header).
        ``recent``: decayed requests per position, in the unit ``g``."""
        n = len(instances)
        chain = pk.chain
        cuts = pk.cuts
        hd = home_block(pk, fstart, fend)
        home = chain[hd]
        sc = scores(home, seeds)
        ranked = sorted(range(n), key=sc.__getitem__, reverse=True)
        total = sum(recent)
        seen = self._homes.get(home, 0.0)
        share = seen / max(total, LOAD_FLOOR * n * g)
        k = min(n, max(1, ceil(share * n * HOT_SPREAD)))
        rk = pk.key
        if k > 1:
            top = sorted(ranked[:k], key=lambda j: ((rk ^ seeds[j]) * _MUL) & MASK64, reverse=True)
            ranked = top + ranked[k:]
        # Follow what the index knows at or past the home block: where earlier prompts
        # through it went (a chat's earlier turns, a document's holders), plus a hot
        # home's top k; ties by the request's own key.
        depth = 0
        if not pk.hinted:
            depth, holders = self.index.longest(chain)
            if depth and (depth > hd or cuts[depth - 1] >= fend):
                cand = {pos[h] for h in holders if h in pos}
                if cand:
                    if k > 1:
                        cand.update(ranked[:k])
                    follow = sorted(
                        cand, key=lambda j: ((rk ^ seeds[j]) * _MUL) & MASK64, reverse=True
                    )
                    ranked = follow + [j for j in ranked if j not in cand]
                    k = len(follow)
                    hd = depth - 1
            else:
                depth = 0
        mean = total / n
        if seen or depth:
            share_cap = mean + epsilon * max(mean, LOAD_FLOOR * g) * WARM_MARGIN
        else:
            # A cold prefix loses nothing by moving: it balances (at most the mean + 1).
            share_cap = mean + g
        pick = -1
        rank = 0
        for r, j in enumerate(ranked):
            if loads[j] < limit and recent[j] < share_cap:
                pick, rank = j, r
                break
        if pick < 0:
            for r, j in enumerate(ranked):
                if loads[j] < limit:
                    pick, rank = j, r
                    break
        if pick >= 0:
            outcome = ("hint" if pk.hinted else "affinity") if rank < k else "spill"
        else:
            least = min(loads)
            pick = next(j for j in ranked if loads[j] == least)
            rank = ranked.index(pick)
            outcome = "fallback"
        matched = hd + 1 if rank < k else 0
        return Choice(
            instances[pick],
            outcome,
            rank,
            matched,
            len(chain),
            (cuts[hd] if matched else 0) // CHARS_PER_TOKEN,
            pk.prompt_chars,
            (home, chain),
        )

    def on_sent(self, home: int, chain: tuple[int, ...], instance_id: str, g: float) -> None:
        """Record the request in the learned index and count its home (``g``: the unit
        of the next decision's counts)."""
        self.index.record(chain, instance_id)
        homes = self._homes
        homes[home] = homes.pop(home, 0.0) + g
        if len(homes) > self.max_homes:
            del homes[next(iter(homes))]

    def rescale(self, g: float) -> None:
        """Divide every count by ``g`` (the caller reset its unit to 1)."""
        for h in self._homes:
            self._homes[h] /= g
