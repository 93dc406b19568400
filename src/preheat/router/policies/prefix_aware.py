"""``prefix_aware``: keep each prompt prefix on the instances whose KV cache holds it.

Algorithm (one decision; no InstT/O, no clock; deterministic given the request stream):

1. **Key.** The canonical prompt text (see ``router/prefix.py``) is cut to its first
   ``prefix_length`` characters and hashed as a keyed chain of ``block_chars`` blocks:
   ``chain[i]`` names the text up to the end of block *i*; the request key is
   ``chain[-1]``. An ``X-Preheat-Prefix-Id`` hint replaces the chain by one hashed id.
2. **Load bound** (bounded-load consistent hashing, Mirrokni et al. 2018). With ``n``
   candidates and ``T`` requests in flight, an instance may take the request only if
   ``in_flight < min(concurrency_threshold, ceil((1 + balance_epsilon) * (T + 1) / n))``.
   No instance thus exceeds ``(1+epsilon)`` x the mean by more than one request.
3. **Warm holders first.** A bounded learned index maps each block hash to the
   instances that were most recently sent a prompt through that block. The longest
   known block of the chain (``matched_blocks``) gives its holders; among holders under
   the load bound the one with the highest rendezvous score *for the request key* wins
   (``affinity``). Scoring by the request key spreads a hot prefix evenly over its warm
   set, and keeps a multi-turn chat (whose later turns extend the earlier chain) on the
   instance that served it.
4. **Spill along the prefix's own order.** If every holder is at its bound, the
   remaining instances are tried in rendezvous order of the *matched block's* hash,
   so a hot prefix's overflow always lands on the same next instance, which warms up
   and joins the holders (``spill``): the warm set grows with the prefix's rate.
5. **Cold prefixes** (nothing matched) go to the first instance under the bound in
   rendezvous order of the request key (``affinity`` if it is the first, ``spill``
   otherwise) and are recorded there, so they stay sticky wherever load placed them.
6. **Fallback.** If every instance is at its bound (all at ``concurrency_threshold``),
   the least-loaded one takes it, ties by rendezvous order (``fallback``).

Thresholds and their meaning (``PolicyParams``):

* ``prefix_length`` (1,024-65,536 chars, default 8,192): how much prompt forms the key;
  cover the shared part (system prompt, document) plus a little unique text.
* ``concurrency_threshold`` (1-1,024, default 64): hard in-flight cap per instance.
* ``balance_epsilon`` (0.01-10, default 0.10): allowed excess over the mean in-flight;
  smaller means tighter balance and more spills (a hot prefix warms more instances).
* ``block_chars`` (512-16,384, default 2,048): matching granularity; fewer, bigger
  blocks hash faster.
* ``index_entries`` (default 200,000): total learned block hashes kept (LRU); the
  memory bound, about 200 bytes per entry.
* ``max_holders`` (1-64, default 8): instances remembered per block (most recent).

Every replica that sees the same requests with the same salt, instance list and loads
makes the same choices, without talking to the others; adding or removing one of N
instances re-ranks only about 1/N of cold keys. No prompt text is kept: the index holds
64-bit keyed hashes and instance ids only.
"""

from __future__ import annotations

import random as _random
from collections import OrderedDict
from collections.abc import Sequence
from math import ceil

from preheat.errors import NoHealthyInstance
from preheat.router.policies.base import BasePolicy, Choice, InstT, PolicyParams, RouteRequest
from preheat.router.prefix import (
    CHARS_PER_TOKEN,
    MASK64,
    SCORE_MULTIPLIER,
    PrefixHasher,
    PrefixKey,
    canonical,
)

_MUL = SCORE_MULTIPLIER


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
        """Note that ``instance_id`` was sent a prompt through every block of ``chain``."""
        d = self._d
        cap = self.max_holders
        for h in chain:
            cur = d.get(h)
            if cur is None:
                d[h] = (instance_id,)
            else:
                if cur[-1] != instance_id:
                    cur = (*(x for x in cur if x != instance_id), instance_id)
                    d[h] = cur[-cap:] if len(cur) > cap else cur
                d.move_to_end(h)
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

    def key(self, request: RouteRequest) -> PrefixKey:
        """The request's prefix key (hint, text or body; see ``RouteRequest``)."""
        body = request.body
        if request.hint:
            n = len(request.text) if request.text is not None else 0
            return self.hasher.hint(request.hint, prompt_chars=n)
        if request.text is not None:
            return self.hasher.chain(request.text, self.params.prefix_length)
        if body is None:
            raise ValueError("a RouteRequest needs a body, a text or a hint")
        model = body.get("model")
        salt = body.get("cache_salt")
        text, ends = canonical(body)
        return self.hasher.chain(
            text,
            self.params.prefix_length,
            boundaries=ends,
            model=model if isinstance(model, str) else None,
            cache_salt=salt if isinstance(salt, str) else None,
        )

    def _seeds(self, instances: Sequence[InstT]) -> tuple[list[int], dict[str, int]]:
        ids = [i.id for i in instances]
        if ids != self._ids:
            seed = self.hasher.seed
            self._ids = ids
            self._seed_list = [seed(x) for x in ids]
            self._pos = {x: j for j, x in enumerate(ids)}
        return self._seed_list, self._pos

    def choose(self, request: RouteRequest, instances: Sequence[InstT]) -> Choice[InstT]:
        n = len(instances)
        if n == 0:
            raise NoHealthyInstance("no instance can take the request")
        p = self.params
        pk = self.key(request)
        chain = pk.chain
        seeds, pos = self._seeds(instances)
        loads = [i.in_flight for i in instances]
        cap = ceil((1.0 + p.balance_epsilon) * (sum(loads) + 1) / n)
        limit = min(cap, p.concurrency_threshold)
        scores = _scores(pk.key, seeds)
        depth, holders = self.index.longest(chain)
        first = "hint" if pk.hinted else "affinity"

        pick = -1
        rank = 0
        outcome = first
        warm: list[int] = []
        if depth:
            # 3. warm holders, best score for the request key first.
            warm = [pos[h] for h in holders if h in pos]
            best = -1
            for j in warm:
                if loads[j] < limit and (best < 0 or scores[j] > scores[best]):
                    best = j
            if best >= 0:
                pick = best
                rank = sum(1 for j in warm if scores[j] > scores[best])
            else:
                # 4. spill along the matched prefix's own rendezvous order.
                order_scores = _scores(chain[depth - 1], seeds)
                order = sorted(range(n), key=order_scores.__getitem__, reverse=True)
                for r, j in enumerate(order):
                    if loads[j] < limit:
                        pick, rank, outcome = j, r, "spill"
                        break
        else:
            # 5. cold: rendezvous order of the request key, first under the bound.
            top = max(range(n), key=scores.__getitem__)
            if loads[top] < limit:
                pick = top
            else:
                best = -1
                for j in range(n):
                    if loads[j] < limit and (best < 0 or scores[j] > scores[best]):
                        best = j
                if best >= 0:
                    pick, outcome = best, "spill"
                    rank = sum(1 for s in scores if s > scores[best])
        if pick < 0:
            # 6. everyone at the bound: least loaded, ties by rendezvous score.
            pick = max(range(n), key=lambda j: (-loads[j], scores[j]))
            rank = sum(1 for s in scores if s > scores[pick])
            outcome = "fallback"

        chosen = instances[pick]
        matched = depth if pick in warm else 0
        return Choice(
            instance=chosen,
            outcome=outcome,
            rank=rank,
            matched_blocks=matched,
            prefix_blocks=len(chain),
            predicted_cached_tokens=min(matched * p.block_chars, pk.prefix_chars)
            // CHARS_PER_TOKEN,
            prompt_chars=pk.prompt_chars,
            state=pk,
        )

    def on_sent(self, request: RouteRequest, choice: Choice[InstT]) -> None:
        pk = choice.state
        if isinstance(pk, PrefixKey):
            self.index.record(pk.chain, choice.instance.id)

    def forget(self, instance_id: str) -> None:
        self.index.forget(instance_id)
