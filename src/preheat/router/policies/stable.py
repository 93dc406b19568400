"""The default (``stable``) placement of ``prefix_aware``: a function of the request and of
state every router replica computes the same way, so replicas agree without talking.

Algorithm (one decision; pure: no I/O, no clock, no randomness):

1. **Traffic counts.** Every block hash of every routed request is counted, decayed by
   ``1 - 1/balance_window`` per request. A block's **share** is its count over
   ``max(total, LOAD_FLOOR * n)``: the part of recent requests whose prompt starts with
   that block. Counts depend on the request stream only (not on a decision or a load),
   so replicas that see the same requests in a slightly different order hold nearly the
   same counts. A block counted in every request so far (at least two: a shared
   system prompt) is as hot as the fleet at once, so it never holds a stream's first
   conversations or documents on the instance its first request went to.
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
3. **Spread with hysteresis.** ``t = HOT_SPREAD * share * n`` is how many instances the
   block's traffic fills to ``1 / HOT_SPREAD`` of a fair share each. ``k`` moves only in
   powers of two (1, 2, 4, ... then n): up to the smallest power >= ``t`` when ``t``
   exceeds ``k``, down only when ``(1 + HYSTERESIS) * t`` fits a smaller power. Few
   transitions, each at a count replicas reach within a few requests of each other.
4. **Weights: capacity and balance, only where nothing is placed yet.** Instance j's
   weight is ``cap_j * exp(-BALANCE_GAIN * (load_j - mean) / max(mean, BALANCE_FLOOR *
   m))``: ``cap_j`` its KV capacity over the largest (router/kvcapacity.py; unknown: the
   mean of the known; all equal: 1), ``load_j`` the decayed requests sent to it, a
   chat's later turns counted through its first (router/policies/stable_load.py: a
   later turn, whose prompt holds an earlier request's whole prompt, is not counted when
   it arrives; the requests of its root weigh ``1 + r``, ``r`` that root's later turns
   per other request), ``m`` the mean of ``1 + r``. Replicas fed the same stream see
   later turns at different moments (each waits for its previous answer), everything
   else in the same order: counting later turns when they arrive made the weights
   differ by the turns in flight, one divergent first turn shifted every later count,
   and chat agreement was 60-79 %; counted this way it is 100 %, live and in process.
   Weighted rendezvous (``w / -ln(u)``) places a cold prefix on the instance with the
   least recent traffic, one copy each: the working set is partitioned over the fleet's
   aggregate KV memory. Weights never move a placed prefix (cold blocks follow the
   index, hot sets keep their members).
5. **Spill only at the limit.** If the pick has ``in_flight >= concurrency_threshold``,
   the request goes to the least predicted TTFT among the next ``SPILL_CANDIDATES``
   under the limit in the deciding block's rendezvous order: uncached prefill there
   (learned index) + ``QUEUED_SHARE`` x the prefill queued on it
   (router/policies/predicted.py); outcome ``spill``. This reads the replica's own
   in-flight counts: where replicas may legitimately disagree (counted as spills). If
   every instance is at the limit: the least in flight (``fallback``).

Outcomes: ``affinity`` (``hint`` for a hinted key) when the pick holds a leading part
of the prompt (learned index, or KV events for synced instances), ``fallback`` when a
cold prefix is placed afresh by its score (a new document, question or conversation),
``spill`` as in step 5.

Thresholds (module constants; ``PolicyParams`` in parentheses):

* ``HOT_SPREAD`` = 1.5: a hot block's members get at most about 2/3 of a fair share each
  from it (2 cost hit rate under KV pressure, 1 balance; docs/benchmarks.md, Router 7).
* ``HYSTERESIS`` = 0.5.
* ``LOAD_FLOOR`` = 10 requests per instance: early shares are taken over at least this
  many requests, so the first requests do not look hot.
* ``BALANCE_GAIN`` = 20 over ``BALANCE_FLOOR`` = 30 requests per instance: an instance
  10 % above the mean load weighs e^-2 as much for new prefixes, and while the mean is
  below 30 requests a one-request difference changes a weight by at most e^(20/30)
  (gain 10 over a floor of 10 let the first requests' order decide; gain 10 over 100
  left RAG documents 1.35x the mean; 20 over 30 was the best pair tried in process
  for agreement and share together). The KV-write term of the previous version (gain
  1) is gone: with this load it moved hit rate and share by less than run-to-run noise.
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
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from math import exp, log
from typing import Any, Protocol

from preheat.router.kvindex import CapacityIndex
from preheat.router.policies.predicted import QUEUED_SHARE, PredictedPlacement
from preheat.router.policies.stable_load import SessionLoad
from preheat.router.prefix import MASK64, SCORE_MULTIPLIER, PrefixKey

__all__ = [
    "BALANCE_GAIN",
    "HOT_SPREAD",
    "HYSTERESIS",
    "SPILL_CANDIDATES",
    "Loads",
    "StablePlacement",
    "capacity_weights",
    "spread_for",
]

_MUL = SCORE_MULTIPLIER
HOT_SPREAD = 1.5
HYSTERESIS = 0.5
LOAD_FLOOR = 10.0
BALANCE_GAIN = 20.0
BALANCE_FLOOR = 30.0
SPILL_CANDIDATES = 2
_TWO64 = float(1 << 64)


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


class Loads(Protocol):
    """In-flight counts by instance position (a list, or a view that reads them lazily:
    a decision that does not spill reads only its pick's)."""

    def __getitem__(self, j: int, /) -> int: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...


class StablePlacement:
    """Traffic counts per block, their spreads, and the decision of the module header."""

    def __init__(self, index: CapacityIndex, max_entries: int, window: int) -> None:
        self.index = index
        self.predicted = PredictedPlacement(index)
        # Counts of cold blocks matter only until they are far down the LRU: a quarter of
        # the index's bound keeps every block with a share worth a spread.
        self.max_entries = max(max_entries // 4, 1000)
        self._decay = 1.0 - 1.0 / window
        # block -> decayed count (in units of _g); insertion order is the LRU.
        self._counts: OrderedDict[int, float] = OrderedDict()
        # Hot blocks only (spread > 1): block -> [spread, members kept (instance ids)].
        self._hot: dict[int, list[Any]] = {}
        self._total = 0.0
        self._g = 1.0
        # Request load per instance, a chat's later turns counted through its first
        # (router/policies/stable_load.py).
        self.load = SessionLoad(self.max_entries)

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
        precise: tuple[Mapping[str, int], Collection[str]] | None = None,
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
        hot = self._hot
        chain = pk.chain
        members = list(range(n))
        # The members as a set once a hot block has narrowed them (None: every instance).
        mset: set[int] | None = None
        decider = chain[0]
        if pos is None:
            pos = {x: j for j, x in enumerate(ids)}
        for b, h in enumerate(chain):
            e = hot.get(h)
            if e is not None:
                k = e[0] if e[0] < n else n
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
                    held += [pos[x] for x, c in chars.items() if c >= mid and x in pos]
                if mset is not None:
                    held = [j for j in held if j in mset]
                if held:
                    members = [max(held, key=lambda j: ((h ^ seeds[j]) * _MUL) & MASK64)]
                    break
                members = [self._best(h, seeds, members, weights(members if mset else None))]
                break
            kept = [pos[x] for x in e[1] or self.index.holders(h) if x in pos]
            if mset is not None:
                kept = [j for j in kept if j in mset]
            if len(kept) != k:
                # New, grown, shrunk or lost a member: keep the members it had (at first,
                # the instances it was sent to), fill up by plain score (not by weight, so
                # replicas with slightly different weights choose the same set).
                sc = self._scores(h, seeds, None)
                kept.sort(key=sc.__getitem__, reverse=True)
                # Fill with the members of the fewest other hot sets (integers that
                # replicas holding the same sets agree on), ties by plain score.
                ks = set(kept)
                busy = self._memberships(pos, n, h)
                rest = sorted((j for j in members if j not in ks), key=lambda j: (-busy[j], sc[j]))
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
            members.sort(key=at.__getitem__, reverse=True)
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

    def _memberships(self, pos: Mapping[str, int], n: int, skip: int) -> list[int]:
        """How many hot sets smaller than the fleet each instance is a member of."""
        busy = [0] * n
        for b, e in self._hot.items():
            if b != skip and e[0] < n:
                for x in e[1]:
                    j = pos.get(x)
                    if j is not None:
                        busy[j] += 1
        return busy

    def _depth(
        self, x: str, pk: PrefixKey, precise: tuple[Mapping[str, int], Collection[str]] | None
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

    @staticmethod
    def _best(h: int, seeds: Sequence[int], members: list[int], w: Sequence[float] | None) -> int:
        """The member with the highest (weighted) rendezvous score of ``h``; ``w`` holds
        the members' weights in order (None: all equal). The first of equal scores wins,
        as ``max`` does."""
        if w is None:
            return max(members, key=lambda j: ((h ^ seeds[j]) * _MUL) & MASK64)
        sc = [
            wj / -log((((h ^ seeds[j]) * _MUL & MASK64) + 0.5) / _TWO64)
            for j, wj in zip(members, w, strict=True)
        ]
        return members[sc.index(max(sc))]

    @staticmethod
    def _scores(h: int, seeds: Sequence[int], weights: Sequence[float] | None) -> list[float]:
        if weights is None:
            return [float(((h ^ s) * _MUL) & MASK64) for s in seeds]
        # Weighted rendezvous (Schindelhauer & Schomaker): w / -ln(u), u uniform in (0, 1).
        return [
            w / -log((((h ^ s) * _MUL & MASK64) + 0.5) / _TWO64)
            for s, w in zip(seeds, weights, strict=True)
        ]

    # --- bookkeeping --------------------------------------------------------------------

    def count(self, pk: PrefixKey, n: int, window: int | None = None) -> None:
        """Count the request's blocks and update their spreads (module header, 1 and 3);
        ``window`` (decisions) replaces the decay given at construction."""
        if window is not None:
            self._decay = 1.0 - 1.0 / window
        g = self._g = self._g / self._decay
        self._total += g
        counts = self._counts
        hot = self._hot
        scale = HOT_SPREAD * n / max(self._total, LOAD_FLOOR * n * g)
        for h in pk.chain:
            c = counts.get(h)
            if c is None:
                c = counts[h] = g
            else:
                c = counts[h] = c + g
                counts.move_to_end(h)
            # In every request so far (a shared system prompt): as hot as the fleet.
            t = HOT_SPREAD * n if c >= self._total and c >= 2 * g else c * scale
            e = hot.get(h)
            if e is None:
                if t <= 1:
                    continue
                k = 1
            else:
                k = e[0]
                # spread_for keeps k (<= n) while t <= k and (1 + HYSTERESIS) * t exceeds
                # the largest power of two below k: then there is nothing to update.
                if k <= n and t <= k and t * (1.0 + HYSTERESIS) > 1 << ((k - 1).bit_length() - 1):
                    continue
            k2 = spread_for(k, t, n)
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
            self.load.rescale(g)
            self._total /= g
            self._g = 1.0

    def weights(
        self,
        ids: Sequence[str],
        capacity: Sequence[float] | None,
        recent: Sequence[float],
        g: float,
        only: Sequence[int] | None = None,
    ) -> list[float] | None:
        """Capacity weights times the balance term of the module header (4); of the
        positions ``only``, in that order (None: every instance). ``recent`` and ``g``,
        the policy's plain request counts, are not read: the load is ``self.load``'s."""
        n = len(ids)
        if n == 0:
            return None
        load, mean, m = self.load.loads(ids, only)
        norm = BALANCE_GAIN / max(mean, BALANCE_FLOOR * self._g * m)
        if only is None:
            base: Sequence[float] = capacity or [1.0] * n
        else:
            base = [capacity[j] for j in only] if capacity else [1.0] * len(only)
        return [w * exp(-norm * (c - mean)) for w, c in zip(base, load, strict=True)]

    def forget(self, instance_id: str) -> None:
        """An instance left: drop its KV-write count and queued prefill (hot sets refill
        without it at their next request)."""
        self.load.forget(instance_id)
        self.predicted.forget(instance_id)

    def spread(self, h: int) -> int:
        """The spread kept for a block (1 when it is not hot)."""
        e = self._hot.get(h)
        return int(e[0]) if e is not None else 1

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
        self.load.add(pk, instance_id, self._g)
        self.predicted.on_sent(pk, instance_id, uncached, body)


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
