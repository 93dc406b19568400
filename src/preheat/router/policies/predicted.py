"""The default (``learned``) placement of ``prefix_aware``: the least predicted TTFT.

Algorithm (one decision; pure: no I/O, no clock, no randomness):

1. **Held depth.** The capacity-modelled learned index (router/kvindex.py) gives, per
   instance, the deepest block of this prompt it still holds. Each engine's LRU is
   modelled in tokens against the KV capacity the engine reports
   (``vllm:cache_config_info``; llama.cpp ``/props``), so a prefix the engine has
   certainly evicted is not counted as held. For an instance whose KV events are
   synced (router/kvprecise.py), the blocks it announced replace that guess.
2. **Predicted TTFT** of an instance j, in prompt characters of prefill (the engines of
   a variant share one timing profile, so prefill work orders them as seconds would):
   ``ttft_j = uncached_j + load_weight * QUEUED_SHARE * queued_j + SHARE_WEIGHT *
   prompt * (recent_j - mean) / max(mean, LOAD_FLOOR)``. ``uncached_j`` is
   the prompt past what j holds; ``queued_j`` the predicted uncached prefill of the
   requests in flight on j (added in ``on_sent``, removed in ``on_done``; 0 when
   nothing is in flight there); ``QUEUED_SHARE`` (0.5) is the part of an in-flight
   request's prefill still ahead of a new one, on average; the last term (``SHARE_WEIGHT``
   = 0.1) charges an instance busier than the mean over the window (a wait the
   in-flight counts do not show). Candidates are every holder
   and the least-loaded instance holding nothing (a cold prefix is placed by load, one
   copy: the working set is partitioned over the fleet's KV memory, not replicated).
   The least wins; ties go to the lower recent request count, then to the highest
   rendezvous score of the request key.
3. **Bounds.** An instance may take the request only if
   * ``in_flight < min(concurrency_threshold, ceil((1+balance_epsilon)(T+1)/n) +
     INFLIGHT_SLACK)`` (bounded-load consistent hashing, Mirrokni et al. 2018, with one
     request of slack so a small fleet at low load keeps affinity; T = all in flight),
   * and its recent request count is below ``mean + balance_epsilon * max(mean,
     LOAD_FLOOR) + 1``; counts decay by ``1 - 1/balance_window`` per decision, so
     request shares stay within about 1 + epsilon of the mean over the window.
4. **Spill along the prefix's own order.** If every holder is at a bound, the request
   goes to the first instance under both bounds in rendezvous order of the deepest
   matched block: a hot prefix's overflow always warms the same next instance, which
   then holds it (``spill``). If nobody is under both bounds, the share bound is
   dropped (least recent count under the in-flight bound), then the least in flight
   (``fallback``).

Outcomes: ``affinity`` (``hint`` for a hinted key) when a holder wins, ``spill`` when a
known prefix goes elsewhere, ``fallback`` for a cold prefix placed by load or when the
bounds leave nobody.

Thresholds: ``balance_epsilon`` (0.10), ``balance_window`` (1,000 decisions),
``concurrency_threshold`` (64), ``SHARE_WEIGHT`` = 0.1, ``load_weight`` (0.05: the queue estimate is a coarse
proxy of TTFT, and in the KV-pressure runs of docs/benchmarks.md weighing it more cost
hit rate without lowering TTFT p90), ``QUEUED_SHARE`` = 0.5, ``LOAD_FLOOR`` = 10
requests, ``INFLIGHT_SLACK`` = 1 request, ``CHARS_PER_TOKEN`` = 4 (token estimates for
the capacity model), and the index's ``CAPACITY_SLACK`` = 1.25 (kvindex.py).

Agreement: the bounds read live in-flight and decision counts, so router replicas that
see requests in different orders drift apart (docs/benchmarks.md, Router 4); use
``placement: hash`` or ``hybrid`` where replicas must agree.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Mapping, Sequence
from math import ceil
from typing import Any

from preheat.router.kvindex import CapacityIndex
from preheat.router.prefix import CHARS_PER_TOKEN, MASK64, SCORE_MULTIPLIER, PrefixKey

__all__ = ["INFLIGHT_SLACK", "LOAD_FLOOR", "PredictedPlacement", "block_tokens"]

_MUL = SCORE_MULTIPLIER
LOAD_FLOOR = 10.0
INFLIGHT_SLACK = 1
# Of a request in flight, the part of its prefill still ahead of a new one, on average.
QUEUED_SHARE = 0.5
# How much an instance's excess recent share (relative to the mean) adds, as a part of
# this prompt's prefill: the wait behind a busier instance that in-flight counts miss.
SHARE_WEIGHT = 0.1


def block_tokens(pk: PrefixKey, body: Mapping[str, Any] | None) -> tuple[list[int], int]:
    """Estimated tokens of each hashed block, and of the rest (unhashed prompt + output)."""
    cuts = pk.cuts
    sizes: list[int] = []
    prev = 0
    for c in cuts[: len(pk.chain)]:
        sizes.append((c - prev) // CHARS_PER_TOKEN)
        prev = c
    tail = (pk.prompt_chars - cuts[-1]) // CHARS_PER_TOKEN
    out = body.get("max_tokens") if body is not None else None
    if type(out) is int and out > 0:
        tail += out
    return sizes, max(tail, 0)


class PredictedPlacement:
    """Queued prefill per instance and the decision of the module header."""

    def __init__(self, index: CapacityIndex) -> None:
        self.index = index
        # Predicted prefill characters of the requests in flight on each instance.
        self.queued: dict[str, int] = {}

    def choose(
        self,
        pk: PrefixKey,
        ids: Sequence[str],
        loads: Sequence[int],
        seeds: Sequence[int],
        recent: Sequence[float],
        order: Sequence[int],
        g: float,
        *,
        epsilon: float,
        load_weight: float,
        threshold: int,
        precise: tuple[Mapping[str, int], Collection[str]] | None = None,
    ) -> tuple[int, str, int, int, int]:
        """(position of the pick, outcome, rank, blocks held there, uncached chars).

        ``precise``: prompt characters held by each instance whose KV events are synced
        (router/kvprecise.py), and those instances; for them it replaces the learned
        index's guess.
        """
        n = len(ids)
        limit = min(ceil((1.0 + epsilon) * (sum(loads) + 1) / n) + INFLIGHT_SLACK, threshold)
        mean = sum(recent) / n
        share_cap = mean + epsilon * max(mean, LOAD_FLOOR * g) + g
        norm = 1.0 / max(mean, LOAD_FLOOR * g)
        if pk.hinted:
            depths = {x: 1 for x in self.index.longest(pk.chain)[1]}
        else:
            depths = self.index.depths(pk.chain)
        cuts = pk.cuts
        prompt = pk.prompt_chars
        queued = self.queued
        key = pk.key
        cands: dict[int, int] = {}
        # Prompt characters held per candidate (the learned depth's cut, or the events').
        hc: dict[int, int] = {}
        if depths or precise:
            pos = {x: j for j, x in enumerate(ids)}
            synced = precise[1] if precise else ()
            for x, d in depths.items():
                j = pos.get(x)
                if j is not None and x not in synced:
                    cands[j] = d
                    hc[j] = cuts[d - 1]
            if precise:
                for x, c in precise[0].items():
                    j = pos.get(x)
                    if j is not None and c > 0:
                        cands[j] = min(max(bisect_right(cuts, c), 1), len(pk.chain))
                        hc[j] = c
        best = -1
        best_cost = 0.0
        best_sc = -1
        best_r = 0.0
        for j in cands:
            if loads[j] >= limit or recent[j] >= share_cap:
                continue
            # Nothing in flight means nothing queued (also if an on_done was lost).
            q = queued.get(ids[j], 0) if loads[j] else 0
            cost = (
                max(prompt - hc[j], 0)
                + load_weight * QUEUED_SHARE * q
                + SHARE_WEIGHT * prompt * (recent[j] - mean) * norm
            )
            r = recent[j]
            if (
                best < 0
                or cost < best_cost
                or (cost == best_cost and r < best_r)
                or (
                    cost == best_cost
                    and r == best_r
                    and ((key ^ seeds[j]) * _MUL) & MASK64 > best_sc
                )
            ):
                best, best_cost, best_r = j, cost, r
                best_sc = ((key ^ seeds[j]) * _MUL) & MASK64
        outcome = "affinity"
        if cands and best < 0:
            # Every holder is at a bound: spill along the matched block's own order, so
            # a hot prefix's overflow always warms the same next instance.
            deepest = max(cands.values())
            m = pk.chain[deepest - 1] if not pk.hinted else key
            ms = [((m ^ s) * _MUL) & MASK64 for s in seeds]
            for j in sorted(range(n), key=ms.__getitem__, reverse=True):
                if loads[j] < limit and recent[j] < share_cap:
                    best, outcome = j, "spill"
                    break
        else:
            # The best instance holding nothing: the least recently used under the
            # bounds (cold prefixes are placed by load, one copy each), if it predicts a
            # lower TTFT than every holder.
            cold = next((j for j in order if loads[j] < limit and recent[j] < share_cap), -1)
            if cold >= 0:
                j = cold
                q = queued.get(ids[j], 0) if loads[j] else 0
                c0 = (
                    prompt
                    + load_weight * QUEUED_SHARE * q
                    + SHARE_WEIGHT * prompt * (recent[j] - mean) * norm
                )
                if best < 0 or c0 < best_cost:
                    best, outcome = j, "spill" if cands else "fallback"
        if best < 0:
            # Nobody under both bounds: drop the share bound, then the least in flight.
            under = [j for j in order if loads[j] < limit]
            if under:
                best, outcome = under[0], "fallback"
            else:
                least = min(loads)
                best = max(
                    (j for j in range(n) if loads[j] == least),
                    key=lambda j: ((key ^ seeds[j]) * _MUL) & MASK64,
                )
                outcome = "fallback"
        d = cands.get(best, 0)
        rank = 0
        if cands and outcome != "affinity":
            rank = len(cands)
        return best, outcome, rank, d, max(prompt - hc.get(best, 0), 0)

    def on_sent(
        self, pk: PrefixKey, instance_id: str, uncached: int, body: Mapping[str, Any] | None
    ) -> None:
        """Record the prompt on the instance in the index; count its queued prefill."""
        self.queued[instance_id] = self.queued.get(instance_id, 0) + uncached
        if pk.hinted:
            self.index.record(pk.chain, instance_id, [max(pk.prompt_chars // CHARS_PER_TOKEN, 1)])
        elif self.index.capacity(instance_id) is None:
            # Block sizes weigh only against a known capacity (kvindex.py): none to count.
            self.index.record(pk.chain, instance_id)
        else:
            sizes, tail = block_tokens(pk, body)
            self.index.record(pk.chain, instance_id, sizes, tail)

    def on_done(self, instance_id: str, uncached: int) -> None:
        """The request's prefill is no longer queued (its response ended)."""
        left = self.queued.get(instance_id, 0) - uncached
        if left > 0:
            self.queued[instance_id] = left
        else:
            self.queued.pop(instance_id, None)

    def forget(self, instance_id: str) -> None:
        self.index.forget(instance_id)
        self.queued.pop(instance_id, None)
