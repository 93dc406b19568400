"""``prefix_aware``: keep each prompt prefix on the instances whose KV cache holds it.

Algorithm (one decision; no I/O, no clock; deterministic given the request stream):

1. **Key.** The canonical prompt text (``router/prefix.py``) is cut to its first
   ``prefix_length`` characters and hashed as a keyed chain: a cut every
   ``block_chars`` characters within a message and at each message end (at least
   ``MIN_CUT`` = 256 characters after the previous cut). ``chain[i]`` names the text up
   to cut *i*, so the next turn of a chat repeats every hash of the previous turn. The
   request key is ``chain[-1]``; an ``X-Preheat-Prefix-Id`` hint replaces the chain by
   one hashed id.
2. **Placement** ``stable-move`` (the default since issue 14's movedefault) is
   ``stable`` with a heavy cold block on an overloaded instance re-homed once
   (router/policies/stable_move.py). ``stable``: hot prefixes own a replica set sized by
   their share of traffic, the first cold block of a prompt stays where it was sent or
   is placed by capacity- and balance-weighted rendezvous hashing, spill only at
   ``concurrency_threshold``: a function of the request and of counts every replica
   computes alike (router/policies/stable.py, with its thresholds). ``learned`` (the
   default before ``stable``): the least predicted TTFT over the capacity-modelled learned
   index, under the in-flight and share bounds, spilling along the matched prefix's own
   rendezvous order (router/policies/predicted.py). With KV events (``precise``, set by
   the router; router/kvprecise.py) the blocks each synced instance announced replace
   the learned guess for it in both. ``hash`` and ``hybrid`` are below.

Thresholds and their meaning (``PolicyParams``; defaults in parentheses):

* ``prefix_length`` (8,192; 1,024-65,536 chars): how much prompt forms the key; cover
  the shared part (system prompt, document) plus a little unique text.
* ``concurrency_threshold`` (64; 1-1,024): hard in-flight cap per instance.
* ``balance_epsilon`` (0.10; 0.01-10): allowed excess over the mean, for in-flight and
  for recent request counts; smaller is tighter balance and more spills.
* ``balance_window`` (1,000 decisions): the memory of the share bound.
* ``load_weight`` (0.05; 0-100): how much queued prefill weighs against uncached
  prefill (predicted.py).
* ``block_chars`` (2,048; 512-16,384): matching granularity; fewer, bigger blocks hash
  faster.
* ``index_entries`` (200,000): learned block hashes kept in total (LRU): the memory
  bound, roughly 200 bytes each.
* ``max_holders`` (8; 1-64): instances remembered per block (the oldest is dropped).
* ``placement`` (``stable-move``; ``stable``, ``stable-split``, ``learned``, ``hash``
  and ``hybrid`` are selectable):
  ``hash`` keeps no state and reads no relative load (the first instance in the key's
  rendezvous order below ``concurrency_threshold``: SageMaker's rule); ``hybrid`` reads
  no in-flight count below it and places nothing by "least loaded" (a home key, hot
  homes spread over the top of their order, a share bound). Both, with their
  constants: router/policies/hybrid.py.

Every replica that sees the same requests in the same order with the same salt, instance
list and in-flight counts makes the same choices without talking to the others. The
learned placement is order-sensitive, though: replicas that see requests in a slightly
different order (concurrent clients, a load balancer in front) drift apart; use
``placement: hybrid`` (agreement on document and template traffic with the
learned placement's hit rate and balance) or ``placement: hash`` (agreement in any order,
at the cost of balance and of chat hit rate). No prompt text is kept:
the index holds 64-bit keyed hashes and instance ids only.

The per-instance bookkeeping (rendezvous seeds, decayed recent request counts and their
order, the capacity weights' staleness) is the base class ``PrefixAwareBook``
(router/policies/prefix_aware_book.py); the placements' own state is here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from preheat.errors import NoHealthyInstance
from preheat.router.kvindex import CapacityIndex
from preheat.router.policies.base import Choice, InstT, PolicyParams, RouteRequest
from preheat.router.policies.hybrid import HybridPlacement, choose_hashed
from preheat.router.policies.predicted import PredictedPlacement, block_tokens
from preheat.router.policies.prefix_aware_book import STABLE_STATE, InFlight, PrefixAwareBook
from preheat.router.policies.stable import Loads, StablePlacement, capacity_weights
from preheat.router.prefix import (
    CHARS_PER_TOKEN,
    PrefixHasher,
    PrefixKey,
    canonical_parts,
)

if TYPE_CHECKING:
    import random as _random

_PREAMBLE_ROLES = ("system", "developer")
# Placements that key a prompt by its home block (the first turn's first block).
_HOMED = ("hybrid",)


class PreciseSource(Protocol):
    """What the policy asks of the precise KV index (router/kvprecise.py)."""

    def lookup(self, body: Mapping[str, Any] | None, ids: Sequence[str]) -> Any: ...

    def sent(self, instance_id: str, lookup: Any) -> None: ...


#: The learned index is the capacity-modelled one (router/kvindex.py) for every placement.
LearnedIndex = CapacityIndex


class PrefixAwarePolicy(PrefixAwareBook[InstT]):
    """Rendezvous ranking + bounded load + learned warm holders (see the module header)."""

    name = "prefix_aware"

    def __init__(
        self, params: PolicyParams, *, salt: bytes, rng: _random.Random | None = None
    ) -> None:
        super().__init__(
            params,
            PrefixHasher(salt, params.block_chars),
            CapacityIndex(params.index_entries, params.max_holders),
        )
        self._predicted = PredictedPlacement(self.index)
        self._stable = StablePlacement(
            self.index,
            params.index_entries,
            params.balance_window,
            split=params.placement == "stable-split",
            move=params.placement == "stable-move",
        )
        # hybrid: decayed request counts per home key (router/policies/hybrid.py).
        self._hybrid = HybridPlacement(self.index, params.index_entries)
        # The precise index of instances with KV events (router/kvprecise.py; set by the
        # router, None without events): ``learned`` uses it instead of the learned guess
        # for each instance it is synced with.
        self.precise: PreciseSource | None = None
        self._body: Mapping[str, Any] | None = None

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
        msgs = body.get("messages") if self.params.placement in _HOMED else None
        if isinstance(msgs, list) and ends:
            # ends: [fields end,] then one end per message.
            off = len(ends) - len(msgs)
            for i, m in enumerate(msgs):
                if isinstance(m, Mapping) and m.get("role") not in _PREAMBLE_ROLES:
                    end = ends[off + i] if off + i < len(ends) else total
                    start = ends[off + i - 1] if off + i >= 1 else 0
                    break
        return pk, start, end

    def choose(self, request: RouteRequest, instances: Sequence[InstT]) -> Choice[InstT]:
        n = len(instances)
        if n == 0:
            raise NoHealthyInstance("no instance can take the request")
        p = self.params
        pk, fstart, fend = self._key(request)
        self._body = request.body
        self._sync(instances)
        seeds = self._seed_list
        if p.placement in ("stable", "stable-move"):
            return self._choose_stable(pk, instances, InFlight(instances), seeds)
        loads = [i.in_flight for i in instances]
        if p.placement == "hash":
            return choose_hashed(pk, instances, loads, seeds, p.concurrency_threshold)
        if p.placement == "hybrid":
            return self._hybrid.choose(
                pk,
                fstart,
                fend,
                instances,
                loads,
                seeds,
                recent=self._rl,
                g=self._g,
                pos=self._pos,
                epsilon=p.balance_epsilon,
                limit=p.concurrency_threshold,
            )
        if p.placement == "learned":
            return self._choose_learned(pk, instances, loads, seeds)
        return self._choose_stable(pk, instances, InFlight(instances), seeds)

    def _choose_stable(
        self, pk: PrefixKey, instances: Sequence[InstT], loads: Loads, seeds: list[int]
    ) -> Choice[InstT]:
        """``placement: stable`` and ``stable-move`` (the default): replica sets sized by
        traffic share, members by the request's own blocks, spill only at a burst limit
        (router/policies/stable.py; the move: stable_move.py)."""
        if not self._weights_ok:
            self._weights = capacity_weights(self._ids, self.index)
            self._weights_ok = True
        lk = None
        if self.precise is not None and not pk.hinted:
            lk = self.precise.lookup(self._body, self._ids)
        pick, outcome, rank, held = self._stable.choose(
            pk,
            self._ids,
            loads,
            seeds,
            lambda only: self._stable.weights(self._ids, self._weights, self._rl, self._g, only),
            threshold=self.params.concurrency_threshold,
            precise=(lk.chars(pk.prompt_chars), lk.synced) if lk is not None else None,
            pos=self._pos,
        )
        if outcome == "affinity" and pk.hinted:
            outcome = "hint"
        cached = pk.cuts[held - 1] if held else 0
        return Choice(
            instances[pick],
            outcome,
            rank,
            held,
            len(pk.chain),
            cached // CHARS_PER_TOKEN,
            pk.prompt_chars,
            (STABLE_STATE, pk, max(pk.prompt_chars - cached, 0), lk),
        )

    def _choose_learned(
        self, pk: PrefixKey, instances: Sequence[InstT], loads: list[int], seeds: list[int]
    ) -> Choice[InstT]:
        """``placement: learned``: the least predicted TTFT under the in-flight and share
        bounds, spilling along the matched prefix's order (router/policies/predicted.py)."""
        p = self.params
        lk = None
        if self.precise is not None and not pk.hinted:
            lk = self.precise.lookup(self._body, self._ids)
        pick, outcome, rank, held, unc = self._predicted.choose(
            pk,
            self._ids,
            loads,
            seeds,
            self._rl,
            self._ordered(),
            self._g,
            epsilon=p.balance_epsilon,
            load_weight=p.load_weight,
            threshold=p.concurrency_threshold,
            precise=(lk.held_chars(pk.prompt_chars), lk.synced) if lk is not None else None,
        )
        if outcome == "affinity" and pk.hinted:
            outcome = "hint"
        return Choice(
            instances[pick],
            outcome,
            rank,
            held,
            len(pk.chain),
            (pk.cuts[held - 1] if held else 0) // CHARS_PER_TOKEN,
            pk.prompt_chars,
            (pk, unc, lk),
        )

    def on_sent(self, request: RouteRequest, choice: Choice[InstT]) -> None:
        placement = self.params.placement
        if placement == "hash":
            return
        pk = choice.state
        window = self.params.balance_window
        iid = choice.instance.id
        if type(pk) is tuple and pk[0] is STABLE_STATE:
            self._stable.on_sent(pk[1], iid, len(self._ids), pk[2], request.body, window)
            if pk[3] is not None and self.precise is not None:
                self.precise.sent(iid, pk[3])
        elif placement == "learned" and isinstance(pk, tuple) and len(pk) == 3:
            self._predicted.on_sent(pk[0], choice.instance.id, pk[1], request.body)
            if pk[2] is not None and self.precise is not None:
                self.precise.sent(choice.instance.id, pk[2])
        elif isinstance(pk, PrefixKey):
            sizes, tail = block_tokens(pk, request.body)
            self.index.record(pk.chain, choice.instance.id, sizes, tail)
        elif isinstance(pk, tuple) and placement == "hybrid":
            home, chain = pk
            g_next = self._g / (1.0 - 1.0 / self.params.balance_window)
            self._hybrid.on_sent(home, chain, choice.instance.id, g_next)
        self._count_sent(iid)

    def _rescaled(self, g: float) -> None:
        self._hybrid.rescale(g)

    def on_done(
        self, request: RouteRequest, choice: Choice[InstT], *, ok: bool, cached_tokens: int | None
    ) -> None:
        st = choice.state
        if isinstance(st, tuple) and len(st) == 3 and isinstance(st[0], PrefixKey):
            self._predicted.on_done(choice.instance.id, st[1])
        elif isinstance(st, tuple) and st[0] is STABLE_STATE:
            self._stable.predicted.on_done(choice.instance.id, st[2])

    def forget(self, instance_id: str) -> None:
        self._predicted.forget(instance_id)
        self._stable.forget(instance_id)
        super().forget(instance_id)
