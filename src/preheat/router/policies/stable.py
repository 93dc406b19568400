"""The ``stable`` placement of ``prefix_aware`` and its variants (``stable-move``, the
default, and ``stable-split``): a function of the request and of state every router
replica computes the same way, so replicas agree without talking.

Algorithm (one decision; pure: no I/O, no clock, no randomness):

1. **Traffic counts** of every block of every request, decayed per request, and each
   block's share of recent requests (router/policies/stable_traffic.py).
2. **Descend the chain.** Start with every instance as the set. For each block of the
   prompt from the root:

   * a **hot** block (spread ``k`` > 1, step 3) narrows the set to its ``k`` members
     (nothing if ``k`` >= the set): the members it had before (at first, the instances
     it was sent to while cold), filled up by the instances that are members of the
     fewest other hot sets smaller than the fleet, ties by the block's plain rendezvous
     score (integers replicas holding the same sets agree on; plain score alone let
     several hot repositories or documents share members, 1.2-1.3x the mean share on
     7-engine code completion); a shared system prompt is as hot as the fleet and narrows nothing, a popular RAG
     document, template or repository context narrows to its own ``k`` instances;
   * the first **cold** block decides: the instance of the set the learned index says
     it was sent to (router/kvindex.py, capacity-modelled, so a prefix the engine has
     certainly evicted is placed afresh), ties by plain score; else the highest
     *weighted* rendezvous score in the set (step 4). That is a conversation's first
     user turn (every later turn repeats its block, so the conversation follows it), a
     document's question (a request picks its member of a hot document's set by its own
     content), a file of a repository.

   If every block is hot (identical prompts), the request key's score picks in the set.
3. **Spread with hysteresis**: a hot block's spread ``k`` follows its share in powers
   of two, with hysteresis (router/policies/stable_traffic.py).
4. **Weights: capacity and balance, only where nothing is placed yet**
   (router/policies/stable_weights.py): a cold prefix goes by weighted rendezvous to an
   instance with little recent traffic (a chat's later turns counted through its first,
   router/policies/stable_load.py), weighed by its KV capacity, one copy each: the
   working set is partitioned over the fleet's aggregate KV memory. Replicas fed the
   same stream see later turns at different moments (each waits for its previous
   answer), everything else in the same order: counting later turns when they arrive
   made the weights differ by the turns in flight, one divergent first turn shifted
   every later count, and chat agreement was 60-79 %; counted through their first it is
   100 %, live and in process. Weights never move a placed prefix (cold blocks follow
   the index, hot sets keep their members).
5. **Spill only at the limit.** If the pick has ``in_flight >= concurrency_threshold``,
   the request goes to the least predicted TTFT among the next ``SPILL_CANDIDATES``
   under the limit in the deciding block's rendezvous order: uncached prefill there
   (learned index) + ``QUEUED_SHARE`` x the prefill queued on it
   (router/policies/predicted.py); outcome ``spill``. This reads the replica's own
   in-flight counts: where replicas may legitimately disagree (counted as spills). If
   every instance is at the limit: the least in flight (``fallback``).

``placement: stable-split`` (``StablePlacement(split=True)``) adds one step between 2 and
3: a heavy cold block whose instance is overloaded gets a second member, filled by the
block's rendezvous order (router/policies/stable_split.py).
``placement: stable-move`` (``StablePlacement(move=True)``, the default since issue 14's
movedefault) changes step 2's cold block:
a heavy one (target >= 0.5) on an instance 10 % above the mean load is re-homed once,
to the first instance of its plain rendezvous order at or below the mean
(router/policies/stable_move.py).

Outcomes: ``affinity`` (``hint`` for a hinted key) when the pick holds a leading part
of the prompt (learned index, or KV events for synced instances), ``fallback`` when a
cold prefix is placed afresh by its score (a new document, question or conversation),
``spill`` as in step 5.

Thresholds (module constants; ``PolicyParams`` in parentheses):

* ``HOT_SPREAD`` = 1.5, ``HYSTERESIS`` = 0.5, ``LOAD_FLOOR`` = 10 requests per instance:
  router/policies/stable_traffic.py.
* ``BALANCE_GAIN`` = 20 over ``BALANCE_FLOOR`` = 30 requests per instance:
  router/policies/stable_weights.py.
* ``SPILL_CANDIDATES`` = 2.
* ``concurrency_threshold`` (64): the hard in-flight cap, the only load limit.
* ``balance_window`` (1,000 requests): the decay of block counts and loads.
* ``index_entries`` (200,000): the learned index's bound; a quarter of it (at least
  1,000) bounds the block counts (LRU) and the keys kept to tell later turns; hot
  blocks are kept only while counted. ``MAX_ROOTS`` (256, stable_load.py) roots.

The policy ``balance_epsilon`` and ``load_weight`` do not apply to this placement.
Measured (docs/benchmarks.md, Router 7, "Agreement on chat"): 4 router processes agree
on 100 % of RAG, templated and multi-turn chat requests at concurrency 8.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from math import log
from typing import Any, Protocol

from preheat.router.kvindex import CapacityIndex
from preheat.router.kvlookup import HeldChars
from preheat.router.policies.predicted import QUEUED_SHARE, PredictedPlacement
from preheat.router.policies.stable_load import SessionLoad
from preheat.router.policies.stable_move import Moves
from preheat.router.policies.stable_split import below_mean, follows, overloaded
from preheat.router.policies.stable_traffic import (
    HOT_SPREAD,
    HYSTERESIS,
    LOAD_FLOOR,
    BlockTraffic,
    spread_for,
)
from preheat.router.policies.stable_weights import (
    BALANCE_FLOOR,
    BALANCE_GAIN,
    balance_weights,
    capacity_weights,
    rendezvous_best,
    rendezvous_scores,
)
from preheat.router.prefix import MASK64, SCORE_MULTIPLIER, PrefixKey

__all__ = [
    "BALANCE_FLOOR",
    "BALANCE_GAIN",
    "HOT_SPREAD",
    "HYSTERESIS",
    "LOAD_FLOOR",
    "SPILL_CANDIDATES",
    "Loads",
    "StablePlacement",
    "capacity_weights",
    "spread_for",
]

_MUL = SCORE_MULTIPLIER
SPILL_CANDIDATES = 2
_TWO64 = float(1 << 64)


class Loads(Protocol):
    """In-flight counts by instance position (a list, or a view that reads them lazily:
    a decision that does not spill reads only its pick's)."""

    def __getitem__(self, j: int, /) -> int: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...


class StablePlacement:
    """Traffic counts per block, their spreads, and the decision of the module header."""

    def __init__(
        self,
        index: CapacityIndex,
        max_entries: int,
        window: int,
        *,
        split: bool = False,
        move: bool = False,
    ) -> None:
        self.index = index
        # ``stable-split``: split a heavy block whose instance is overloaded
        # (router/policies/stable_split.py); off for ``stable``.
        self.split = split
        self.predicted = PredictedPlacement(index)
        # Counts of cold blocks matter only until they are far down the LRU: a quarter of
        # the index's bound keeps every block with a share worth a spread.
        self.max_entries = max(max_entries // 4, 1000)
        self.traffic = BlockTraffic(self.max_entries, window)
        # Request load per instance, a chat's later turns counted through its first
        # (router/policies/stable_load.py).
        self.load = SessionLoad(self.max_entries)
        # ``stable-move``: re-home a heavy cold block off an overloaded instance once
        # (router/policies/stable_move.py); None for ``stable``.
        self.move = Moves() if move else None

    # --- decision -----------------------------------------------------------------------

    def choose(
        self,
        pk: PrefixKey,
        ids: Sequence[str],
        loads: Loads,
        seeds: Sequence[int],
        weights: Callable[[Sequence[int] | None], Sequence[float] | None],
        *,
        threshold: int,
        precise: tuple[HeldChars, Collection[str]] | None = None,
        pos: Mapping[str, int] | None = None,
    ) -> tuple[int, str, int, int]:
        """(position of the pick, outcome, rank in the deciding block's order, blocks of
        the prompt the learned index believes it holds). ``weights(only)`` gives step 4's
        weights of the positions ``only`` (None: every instance), in that order; it is
        called only when a weight decides (a prefix placed afresh).
        ``precise``: prompt characters held by each instance whose KV events are synced
        (router/kvprecise.py), and those instances; for them it replaces the learned
        index when a cold block looks for where it is held."""
        n = len(ids)
        hot = self.traffic.hot
        chain = pk.chain
        # Every instance (a range: most decisions narrow it at once, so no list is built).
        members: list[int] | range = range(n)
        # The members as a set once a hot block has narrowed them (None: every instance).
        mset: set[int] | None = None
        decider = chain[0]
        if pos is None:
            pos = {x: j for j, x in enumerate(ids)}
        split = self.split
        # stable-split: the spread and target of the last block split for load in this
        # descent (router/policies/stable_split.py); 0: none yet.
        sk, st = 0, 0.0
        for b, h in enumerate(chain):
            e = hot.get(h)
            if e is not None:
                k = e[0] if e[0] < n else n
                cont = False
                if split and (sk or len(e) > 2):
                    if sk and follows(self.traffic, h, st, n):
                        # Carries its split parent's traffic: split alike, no load check.
                        cont = True
                        if sk > k:
                            k = sk
                            e = self.traffic.grow(h, e[1], k)
                    elif len(e) > 2:
                        sk, st = k, self.traffic.target(h, n)
                if k >= len(members):
                    continue
            elif len(members) <= 1:
                continue
            decider = h
            if e is None:
                # A cold block stays where it was sent (the learned index's holders in
                # the set; the plain score breaks ties, so weights never move it).
                held = [pos[x] for x in self.index.holders(h) if x in pos]
                if precise is not None:
                    # Synced instances: what their KV events announced replaces the guess.
                    chars, synced = precise
                    # Held: past the middle of the block (the characters are pro rata).
                    mid = (pk.cuts[b] + (pk.cuts[b - 1] if b else 0)) / 2
                    held = [j for j in held if ids[j] not in synced]
                    held += [pos[x] for x in chars.at_least(mid) if x in pos]
                if mset is not None:
                    held = [j for j in held if j in mset]
                if not held:
                    w0 = weights(members if mset else None)
                    members = [self._best(h, seeds, list(members), w0)]
                    break
                j0 = max(held, key=lambda j: ((h ^ seeds[j]) * _MUL) & MASK64)
                if self.move is not None:
                    j0 = self.move.home(
                        self.traffic, self.load, h, j0, list(members), ids, pos, seeds
                    )
                if not split:
                    members = [j0]
                    break
                cont = bool(sk) and follows(self.traffic, h, st, n)
                if cont:
                    k = sk
                elif overloaded(self.traffic, self.load, h, [j0], ids, n):
                    k, sk, st = 2, 2, self.traffic.target(h, n)
                else:
                    members = [j0]
                    break
                e = self.traffic.grow(h, (ids[j0],), k)
                if k >= len(members):
                    continue
            kept = [pos[x] for x in e[1] or self.index.holders(h) if x in pos]
            if mset is not None:
                kept = [j for j in kept if j in mset]
            if (
                split
                and not cont
                and len(e) > 2
                and len(kept) == k < len(members)
                and overloaded(self.traffic, self.load, h, kept, ids, n)
            ):
                # Every member of a split set overloaded: double it.
                k = sk = min(2 * k, n)
                e = self.traffic.grow(h, e[1], k)
                if k >= len(members):
                    continue
            if len(kept) != k:
                # New, grown, shrunk or lost a member: keep the members it had (at first,
                # the instances it was sent to), fill up by plain score (not by weight, so
                # replicas with slightly different weights choose the same set).
                sc = self._scores(h, seeds, None)
                kept.sort(key=sc.__getitem__, reverse=True)
                ks = set(kept)
                # Sorted by score, then (stable) by the first key: the order of the key
                # (first, score) in two C-keyed sorts, without a tuple per comparison.
                rest = [j for j in members if j not in ks]
                rest.sort(key=sc.__getitem__)
                if len(e) > 2:
                    # Split for load: fill by the block's plain rendezvous order, the
                    # instances at most at the mean load first (stable_split.py).
                    rest.sort(key=below_mean(self.load, ids).__getitem__)
                else:
                    # Fill with the members of the fewest other hot sets (integers that
                    # replicas holding the same sets agree on), ties by plain score.
                    busy = self.traffic.memberships(pos, n, h)
                    rest.sort(key=busy.__getitem__, reverse=True)
                while len(kept) < k and rest:
                    kept.append(rest.pop())
                del kept[k:]
                e[1] = tuple(ids[j] for j in kept)
            members = kept
            mset = set(kept)
        if len(members) > 1:
            # The whole prompt is as hot as its set (identical prompts): its key decides.
            decider = pk.key
            w = weights(members if mset else None)
            if w is None:
                sc = [float(((decider ^ seeds[j]) * _MUL) & MASK64) for j in members]
            else:
                sc = [
                    wj / -log((((decider ^ seeds[j]) * _MUL & MASK64) + 0.5) / _TWO64)
                    for j, wj in zip(members, w, strict=True)
                ]
            at = dict(zip(members, sc, strict=True))
            members = sorted(members, key=at.__getitem__, reverse=True)
        pick = members[0]
        if loads[pick] < threshold:
            depth = self._depth(ids[pick], pk, precise)
            # affinity: the pick holds a leading part of the prompt (hinted: its key);
            # fallback: a cold prefix placed afresh by its rendezvous score.
            known = depth or (pk.hinted and ids[pick] in self.index.holders(pk.key))
            return pick, "affinity" if known else "fallback", 0, depth
        depths = self.index.depths(chain) if not pk.hinted else {}
        if precise is not None:
            chars, synced = precise
            for x in synced:
                depths.pop(x, None)
            for x, c in chars.items():
                d = min(bisect_right(pk.cuts, c), len(chain))
                if d:
                    depths[x] = d
        sc = self._scores(decider, seeds, weights(None))
        order = sorted(range(n), key=sc.__getitem__, reverse=True)
        under = [j for j in order if loads[j] < threshold][:SPILL_CANDIDATES]
        if not under:
            least = min(loads)
            j = next(j for j in order if loads[j] == least)
            return j, "fallback", order.index(j), depths.get(ids[j], 0)
        cuts = pk.cuts
        queued = self.predicted.queued

        def cost(j: int) -> float:
            d = depths.get(ids[j], 0)
            held = cuts[d - 1] if d else 0
            q = queued.get(ids[j], 0) if loads[j] else 0
            return max(pk.prompt_chars - held, 0) + QUEUED_SHARE * q

        j = min(under, key=cost)
        return j, "spill", order.index(j), depths.get(ids[j], 0)

    def _depth(
        self, x: str, pk: PrefixKey, precise: tuple[HeldChars, Collection[str]] | None
    ) -> int:
        """``depths(...)[x]`` of ``choose`` for one instance, without the full map."""
        chain = pk.chain
        if precise is not None:
            chars, synced = precise
            c = chars.get(x)
            if c is not None:
                d = min(bisect_right(pk.cuts, c), len(chain))
                if d:
                    return d
            if x in synced:
                return 0
        if pk.hinted:
            return 0
        get = self.index.holders
        for j in range(len(chain) - 1, -1, -1):
            if x in get(chain[j]):
                return j + 1
        return 0

    _best = staticmethod(rendezvous_best)
    _scores = staticmethod(rendezvous_scores)

    # --- bookkeeping --------------------------------------------------------------------

    def count(self, pk: PrefixKey, n: int, window: int | None = None) -> None:
        """Count the request's blocks and update their spreads (stable_traffic.py);
        ``window`` (decisions) replaces the decay given at construction."""
        reset = self.traffic.count(pk, n, window)
        if reset is not None:
            self.load.rescale(reset)

    def weights(
        self,
        ids: Sequence[str],
        capacity: Sequence[float] | None,
        recent: Sequence[float],
        g: float,
        only: Sequence[int] | None = None,
    ) -> Sequence[float] | None:
        """Capacity weights times the balance term (stable_weights.py); of the positions
        ``only``, in that order (None: every instance). ``recent`` and ``g``, the
        policy's plain request counts, are not read: the load is ``self.load``'s."""
        return balance_weights(self.load, ids, capacity, self.traffic.g, only)

    def forget(self, instance_id: str) -> None:
        """An instance left: drop its KV-write count and queued prefill (hot sets refill
        without it at their next request)."""
        self.load.forget(instance_id)
        if self.move is not None:
            self.move.forget(instance_id)
        self.predicted.forget(instance_id)

    def spread(self, h: int) -> int:
        """The spread kept for a block (1 when it is not hot)."""
        return self.traffic.spread(h)

    def on_sent(
        self,
        pk: PrefixKey,
        instance_id: str,
        n: int,
        uncached: int,
        body: Mapping[str, Any] | None,
        window: int | None = None,
    ) -> None:
        """Count the request, record it in the learned index and queue its ``uncached``
        prefill characters on the instance (``predicted.on_done`` removes them)."""
        self.count(pk, n, window)
        self.load.add(pk, instance_id, self.traffic.g)
        self.predicted.on_sent(pk, instance_id, uncached, body)
