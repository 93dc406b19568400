"""``prefix_aware``: keep each prompt prefix on the instances whose KV cache holds it.

Algorithm (one decision; no I/O, no clock; deterministic given the request stream):

1. **Key.** The canonical prompt text (``router/prefix.py``) is cut to its first
   ``prefix_length`` characters and hashed as a keyed chain: a cut every
   ``block_chars`` characters within a message and at each message end (at least
   ``MIN_CUT`` = 256 characters after the previous cut). ``chain[i]`` names the text up
   to cut *i*, so the next turn of a chat repeats every hash of the previous turn. The
   request key is ``chain[-1]``; an ``X-Preheat-Prefix-Id`` hint replaces the chain by
   one hashed id.
2. **Bounds.** With ``n`` candidates and ``T`` requests in flight, an instance may take
   the request only if
   * ``in_flight < min(concurrency_threshold, ceil((1+balance_epsilon)(T+1)/n) + 1)``
     (bounded-load consistent hashing, Mirrokni et al. 2018, with one request of slack
     ``INFLIGHT_SLACK`` so a small fleet at low load keeps affinity), and
   * its recent request count is below ``mean + balance_epsilon * max(mean, 10) + 1``.
     Recent counts decay by ``1 - 1/balance_window`` per decision, so request *shares*
     stay within about (1+epsilon) of the mean over the window (an instance that serves
     cache hits finishes faster, so an in-flight bound alone does not balance shares).
   If no instance passes both, the share bound is dropped; if none passes the
   in-flight bound either, the least-loaded instance takes it (``fallback``).
3. **Learned holders.** A bounded LRU index maps each block hash to the (up to
   ``max_holders``) instances most recently sent a prompt through it. The longest known
   block of the chain gives ``matched_blocks`` and its holders.
4. **Choice.** Among instances under the bounds, the highest
   ``value = cached_share - load_weight * (recent - mean) / max(mean, 10)`` wins, where
   ``cached_share`` is the matched part of the prompt (0-1) for a holder and 0 for any
   other instance; ties go to the highest rendezvous score of the request key. A deep
   match (a document, a long chat) therefore stays put until its holder is well above
   the mean, while a shallow one (a short system prompt every instance will soon hold)
   barely matters, and cold prefixes go to the least-loaded instance, then stay sticky
   through the index. Outcomes: ``affinity`` (``hint`` for a hinted key) when a holder
   wins; ``spill`` when the prefix is known but a non-holder wins; ``fallback`` for a
   cold prefix (placed by load) or when every instance is at its in-flight bound.
5. **Spill along the prefix's own order.** If every holder is at a bound, the others
   are tried in rendezvous order of the *matched block's* hash, so a hot prefix's
   overflow always lands on the same next instance, which warms up and joins the
   holders: the warm set grows with the prefix's request rate (``spill``).

Thresholds and their meaning (``PolicyParams``; defaults in parentheses):

* ``prefix_length`` (8,192; 1,024-65,536 chars): how much prompt forms the key; cover
  the shared part (system prompt, document) plus a little unique text.
* ``concurrency_threshold`` (64; 1-1,024): hard in-flight cap per instance.
* ``balance_epsilon`` (0.10; 0.01-10): allowed excess over the mean, for in-flight and
  for recent request counts; smaller is tighter balance and more spills.
* ``balance_window`` (1,000 decisions): the memory of the share bound.
* ``load_weight`` (1.0; 0-100): how strongly excess load offsets a cached share.
* ``block_chars`` (2,048; 512-16,384): matching granularity; fewer, bigger blocks hash
  faster.
* ``index_entries`` (200,000): learned block hashes kept in total (LRU): the memory
  bound, roughly 200 bytes each.
* ``max_holders`` (8; 1-64): instances remembered per block (the oldest is dropped).
* ``placement`` (``learned``): ``hash`` skips steps 2-5 but the hard cap: the first
  instance in rendezvous order of the key below ``concurrency_threshold`` wins
  (SageMaker's rule). It keeps no state and reads no relative load, so replicas agree
  whatever order they see requests in, at the cost of balance (a hot prefix stays on
  one instance until the cap) and of prompts that outgrow ``prefix_length``.
* ``placement: hybrid`` replaces steps 2-5 by rules that read no in-flight count below
  ``concurrency_threshold`` and place nothing by "least loaded":

  a. **Home key**: the chain hash at the first cut at least ``HOME_CHARS`` (1,024) into
     the first turn (the first message that is not a system/developer message, or the
     whole completion prompt), or at that turn's end if it is shorter: a conversation's
     first user turn (every later turn repeats it), a RAG document's first block, a
     template's first block.
  b. **Hot homes own k instances**: with ``s`` the home's share of recent requests
     (decayed like the counts of step 2), it owns the top ``k = ceil(HOT_SPREAD * s *
     n)`` (``HOT_SPREAD`` = 2) of its rendezvous order; a request picks among them by
     its own key's rendezvous score. ``s`` comes from the request stream alone.
  c. **Follow**: if the learned index knows a block at or past the home block (or the
     end of the first turn: a chat's earlier turn), its holders (with the hot top k)
     come first, ties by the request key; a conversation that once moved stays moved.
  d. **Share bound, spill along the home's order**: the first candidate whose recent
     count is below ``mean + WARM_MARGIN * balance_epsilon * max(mean, LOAD_FLOOR)``
     (``WARM_MARGIN`` = 0.8: the bound is on decayed counts) takes it; a cold home
     (never seen) uses ``mean + 1`` instead, since it loses nothing by moving, so cold
     traffic does the balancing. Then any instance under ``concurrency_threshold``,
     then the least loaded (``fallback``).

  Replicas agree whatever in-flight counts they see (every input is the stream and the
  decisions made on it); they diverge only when they see requests in a different order
  near a share-bound decision, and a diverged decision shifts later counts, so
  divergence compounds: in process, 1 % of adjacent RAG requests swapped leaves 85 %
  agreement. Measured (docs/benchmarks.md, Router 3-4): 4 router processes agree on
  100 % of RAG and 90-100 % of templated requests at concurrency 8 but only 38-43 % of
  multi-turn chat (a turn waits for its previous answer, so replicas see turns in different
  orders and a conversation's first turn decides all its turns).
* ``LOAD_FLOOR`` = 10 requests, ``INFLIGHT_SLACK`` = 1 request: constants above.

Every replica that sees the same requests in the same order with the same salt, instance
list and in-flight counts makes the same choices without talking to the others. The
learned placement is order-sensitive, though: replicas that see requests in a slightly
different order (concurrent clients, a load balancer in front) drift apart; use
``placement: hybrid`` (agreement on document and template traffic with the
learned placement's hit rate and balance) or ``placement: hash`` (agreement in any order,
at the cost of balance and of chat hit rate). No prompt text is kept:
the index holds 64-bit keyed hashes and instance ids only.
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from math import ceil
from typing import TYPE_CHECKING

from preheat.errors import NoHealthyInstance
from preheat.router.policies.base import BasePolicy, Choice, InstT, PolicyParams, RouteRequest
from preheat.router.prefix import (
    CHARS_PER_TOKEN,
    MASK64,
    SCORE_MULTIPLIER,
    PrefixHasher,
    PrefixKey,
    canonical_parts,
)

if TYPE_CHECKING:
    import random as _random

_MUL = SCORE_MULTIPLIER
LOAD_FLOOR = 10.0
INFLIGHT_SLACK = 1
# hybrid: the home key is the first cut at least this far into the first turn.
HOME_CHARS = 1024
# hybrid: a home with request share s owns the top ceil(HOT_SPREAD * s * n) instances.
HOT_SPREAD = 2.0
# hybrid: a known prefix may exceed the mean by this part of ``balance_epsilon`` (the
# bound is on decayed counts; the margin keeps plain shares within 1 + epsilon).
WARM_MARGIN = 0.8
_PREAMBLE_ROLES = ("system", "developer")
_INF = float("inf")


def _scores(key: int, seeds: list[int]) -> list[int]:
    # prefix.score inlined: this is the decision's hot path at 64 instances.
    return [((key ^ s) * _MUL) & MASK64 for s in seeds]


class LearnedIndex:
    """Recently routed block hashes -> the instances they went to (bounded, LRU)."""

    def __init__(self, max_entries: int, max_holders: int) -> None:
        self.max_entries = max_entries
        self.max_holders = max_holders
        self._d: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def longest(self, chain: Sequence[int]) -> tuple[int, tuple[str, ...]]:
        """(number of leading blocks known, their holders); (0, ()) for a cold chain."""
        d = self._d
        for j in range(len(chain) - 1, -1, -1):
            holders = d.get(chain[j])
            if holders is not None:
                return j + 1, holders
        return 0, ()

    def record(self, chain: Sequence[int], instance_id: str) -> None:
        """Note that ``instance_id`` was sent a prompt through every block of ``chain``.

        Holders of a block are kept in the order they first got it; the oldest is
        dropped when a block has ``max_holders``.
        """
        d = self._d
        cap = self.max_holders
        move = d.move_to_end
        for h in chain:
            cur = d.get(h)
            if cur is None:
                d[h] = (instance_id,)
            else:
                if instance_id not in cur:
                    d[h] = (*cur[1:], instance_id) if len(cur) >= cap else (*cur, instance_id)
                move(h)
        while len(d) > self.max_entries:
            d.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        """Drop an instance that left the variant from every entry."""
        for h, holders in list(self._d.items()):
            if instance_id in holders:
                rest = tuple(x for x in holders if x != instance_id)
                if rest:
                    self._d[h] = rest
                else:
                    del self._d[h]


class PrefixAwarePolicy(BasePolicy[InstT]):
    """Rendezvous ranking + bounded load + learned warm holders (see the module header)."""

    name = "prefix_aware"

    def __init__(
        self, params: PolicyParams, *, salt: bytes, rng: _random.Random | None = None
    ) -> None:
        self.params = params
        self.hasher = PrefixHasher(salt, params.block_chars)
        self.index = LearnedIndex(params.index_entries, params.max_holders)
        self._ids: list[str] = []
        self._seed_list: list[int] = []
        self._pos: dict[str, int] = {}
        self._recent: dict[str, float] = {}
        self._rl: list[float] = []
        # Positions into ``_rl`` by ascending recent count: the least-loaded instance under
        # the in-flight bound is the first of them below it, found without a full pass.
        self._order: list[int] = []
        self._last: Sequence[InstT] | None = None
        self._g = 1.0
        # hybrid: decayed request counts per home key (insertion-ordered dict as an LRU).
        self._homes: dict[int, float] = {}

    def key(self, request: RouteRequest) -> PrefixKey:
        """The request's prefix key (hint, text or body; see ``RouteRequest``)."""
        return self._key(request)[0]

    def _key(self, request: RouteRequest) -> tuple[PrefixKey, int, int]:
        """The prefix key, and where the first turn (the first message that is not a
        system or developer message, or the whole prompt) starts and ends."""
        body = request.body
        if request.hint:
            n = len(request.text) if request.text is not None else 0
            return self.hasher.hint(request.hint, prompt_chars=n), 0, 0
        if request.text is not None:
            n = len(request.text)
            return self.hasher.chain(request.text, self.params.prefix_length), 0, n
        if body is None:
            raise ValueError("a RouteRequest needs a body, a text or a hint")
        model = body.get("model")
        salt = body.get("cache_salt")
        parts, ends, total = canonical_parts(body)
        pk = self.hasher.chain_parts(
            parts,
            total,
            self.params.prefix_length,
            boundaries=ends,
            model=model if isinstance(model, str) else None,
            cache_salt=salt if isinstance(salt, str) else None,
        )
        start, end = 0, total
        msgs = body.get("messages") if self.params.placement == "hybrid" else None
        if isinstance(msgs, list) and ends:
            # ends: [fields end,] then one end per message.
            off = len(ends) - len(msgs)
            for i, m in enumerate(msgs):
                if isinstance(m, Mapping) and m.get("role") not in _PREAMBLE_ROLES:
                    end = ends[off + i] if off + i < len(ends) else total
                    start = ends[off + i - 1] if off + i >= 1 else 0
                    break
        return pk, start, end

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

    def choose(self, request: RouteRequest, instances: Sequence[InstT]) -> Choice[InstT]:
        n = len(instances)
        if n == 0:
            raise NoHealthyInstance("no instance can take the request")
        p = self.params
        eps = p.balance_epsilon
        pk, fstart, fend = self._key(request)
        chain = pk.chain
        self._sync(instances)
        seeds = self._seed_list
        pos = self._pos
        recent = self._rl
        g = self._g
        loads = [i.in_flight for i in instances]
        if p.placement == "hash":
            return self._choose_hashed(pk, instances, loads, seeds)
        if p.placement == "hybrid":
            return self._choose_hybrid(pk, fstart, fend, instances, loads, seeds)
        # 2. bounds: in-flight (bounded-load hashing + slack) and recent request counts.
        limit = min(
            ceil((1.0 + eps) * (sum(loads) + 1) / n) + INFLIGHT_SLACK, p.concurrency_threshold
        )
        mean = sum(recent) / n
        share_cap = mean + eps * max(mean, LOAD_FLOOR * g) + g
        # ``low``: the least recent count under both bounds. The first instance in
        # ascending recent order that is under the in-flight bound has it; if even that
        # one is at the share bound, nobody is under both and the share bound is dropped.
        low = _INF
        ties: list[int] = []
        for j in self._order:
            if low == _INF:
                if loads[j] < limit:
                    low = recent[j]
                    ties.append(j)
            elif recent[j] != low:
                break
            elif loads[j] < limit:
                ties.append(j)
        if low >= share_cap:
            share_cap = _INF
        depth, holders = self.index.longest(chain)
        warm = [pos[h] for h in holders if h in pos] if depth else []
        key = pk.key

        pick = -1
        rank = 0
        outcome = "fallback"
        # A holder's recent count if it is under both bounds, else inf.
        wm = [recent[j] if loads[j] < limit and recent[j] < share_cap else _INF for j in warm]
        if warm and low != _INF and min(wm) == _INF:
            # 5. every holder is at a bound: spill along the matched prefix's own
            # rendezvous order, so its overflow always warms the same next instance.
            order = _scores(chain[depth - 1], seeds)
            eligible = [
                o if x < limit and r < share_cap else -1
                for o, x, r in zip(order, loads, recent, strict=True)
            ]
            pick = eligible.index(max(eligible))
            top = order[pick]
            rank = sum(1 for o in order if o > top)
            outcome = "spill"
        elif low != _INF:
            # 4. value = cached share - load_weight * excess load; the best non-holder
            # is simply the least loaded under the bounds (ties by rendezvous score).
            norm = p.load_weight / max(mean, LOAD_FLOOR * g)
            if len(ties) == 1:
                pick = ties[0]
            else:
                pick = max(ties, key=lambda j: ((key ^ seeds[j]) * _MUL) & MASK64)
            if warm:
                best_v = -(low - mean) * norm
                frac = 1.0 if pk.hinted else min(1.0, pk.cuts[depth - 1] / max(pk.prompt_chars, 1))
                for j, cnt in zip(warm, wm, strict=True):
                    if cnt != _INF:
                        v = frac - (cnt - mean) * norm
                        if v > best_v or j == pick:
                            pick, best_v = j, v
                if pick in warm:
                    outcome = "hint" if pk.hinted else "affinity"
                    sj = ((key ^ seeds[pick]) * _MUL) & MASK64
                    rank = sum(1 for j in warm if ((key ^ seeds[j]) * _MUL) & MASK64 > sj)
                else:
                    outcome = "spill"
        if pick < 0:
            # everyone at the in-flight bound: least loaded, ties by rendezvous score.
            least = min(loads)
            ties = [j for j, x in enumerate(loads) if x == least]
            pick = max(ties, key=lambda j: ((key ^ seeds[j]) * _MUL) & MASK64)

        chosen = instances[pick]
        matched = depth if pick in warm else 0
        # Positional (instance, outcome, rank, matched_blocks, prefix_blocks,
        # predicted_cached_tokens, prompt_chars, state): half the cost of keywords.
        return Choice(
            chosen,
            outcome,
            rank,
            matched,
            len(chain),
            (pk.cuts[matched - 1] if matched else 0) // CHARS_PER_TOKEN,
            pk.prompt_chars,
            pk,
        )

    def _choose_hashed(
        self, pk: PrefixKey, instances: Sequence[InstT], loads: list[int], seeds: list[int]
    ) -> Choice[InstT]:
        """``placement: hash``: rendezvous order of the key, skipping instances at
        ``concurrency_threshold`` (SageMaker's spill rule); no learned state and no
        relative load bound, so replicas agree whatever order they see requests in."""
        n = len(instances)
        limit = self.params.concurrency_threshold
        scores = _scores(pk.key, seeds)
        eligible = [sc if x < limit else -1 for sc, x in zip(scores, loads, strict=True)]
        best = max(eligible)
        if best >= 0:
            pick = eligible.index(best)
            rank = sum(1 for sc in scores if sc > best)
            outcome = ("hint" if pk.hinted else "affinity") if rank == 0 else "spill"
        else:
            pick = max(range(n), key=lambda j: (-loads[j], scores[j]))
            rank = sum(1 for sc in scores if sc > scores[pick])
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

    def _choose_hybrid(
        self,
        pk: PrefixKey,
        fstart: int,
        fend: int,
        instances: Sequence[InstT],
        loads: list[int],
        seeds: list[int],
    ) -> Choice[InstT]:
        """``placement: hybrid``: the rendezvous order of a stable home key, a hot home
        spread over the top ``k`` of its order, the share bound, spill along the order.
        Reads only the request stream's own statistics and the hard in-flight cap, so
        replicas that see the same stream agree (see the module header)."""
        p = self.params
        n = len(instances)
        g = self._g
        recent = self._rl
        chain = pk.chain
        cuts = pk.cuts
        hd = len(chain) - 1
        if not pk.hinted and hd > 0:
            t = min(fstart + HOME_CHARS, fend)
            for i, c in enumerate(cuts):
                if c >= t:
                    hd = i
                    break
        home = chain[hd]
        scores = _scores(home, seeds)
        ranked = sorted(range(n), key=scores.__getitem__, reverse=True)
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
                pos = self._pos
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
        limit = p.concurrency_threshold
        mean = total / n
        if seen or depth:
            share_cap = mean + p.balance_epsilon * max(mean, LOAD_FLOOR * g) * WARM_MARGIN
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

    def on_sent(self, request: RouteRequest, choice: Choice[InstT]) -> None:
        placement = self.params.placement
        if placement == "hash":
            return
        pk = choice.state
        if isinstance(pk, PrefixKey):
            self.index.record(pk.chain, choice.instance.id)
        elif isinstance(pk, tuple) and placement == "hybrid":
            home, chain = pk
            self.index.record(chain, choice.instance.id)
            homes = self._homes
            homes[home] = homes.pop(home, 0.0) + self._g / (1.0 - 1.0 / self.params.balance_window)
            if len(homes) > self.params.index_entries:
                del homes[next(iter(homes))]
        # Decayed request counts: each count shrinks by (1 - 1/balance_window) per
        # decision; growing the unit instead of shrinking every count keeps this O(1).
        g = self._g = self._g / (1.0 - 1.0 / self.params.balance_window)
        iid = choice.instance.id
        j = self._pos.get(iid)
        if j is not None and j < len(self._ids) and self._ids[j] == iid:
            rl = self._rl
            rl[j] += g
            order = self._order
            order.remove(j)
            insort(order, j, key=rl.__getitem__)
        else:
            self._recent[iid] = self._recent.get(iid, 0.0) + g
        if g > 1e12:
            self._rl = [c / g for c in self._rl]
            for k in self._recent:
                self._recent[k] /= g
            for h in self._homes:
                self._homes[h] /= g
            self._g = 1.0

    def forget(self, instance_id: str) -> None:
        self.index.forget(instance_id)
        for x, c in zip(self._ids, self._rl, strict=True):
            self._recent[x] = c
        self._recent.pop(instance_id, None)
        self._ids = []
        self._rl = []
        self._last = None
