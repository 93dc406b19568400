"""The learned KV index with each engine's LRU modelled in tokens (pure).

A router that has no events from its engines learns where prefixes are from its own
decisions: after sending a prompt through blocks ``chain`` to instance X, X holds those
blocks. An engine's prefix cache is finite, though: vLLM evicts the least recently
freed blocks when it needs room, so a block X got long ago, followed by more prompt
tokens than X's KV cache holds, is gone. ``CapacityIndex`` models that:

* Per instance, an LRU of the blocks sent to it, each weighed in tokens (the block's
  characters / ``CHARS_PER_TOKEN``), plus one anonymous entry per request for the part
  of the prompt past the hashed prefix and for its output (they take KV memory too;
  they are put before the request's own blocks, as vLLM frees a sequence tail first).
* When an instance's modelled use exceeds ``capacity x CAPACITY_SLACK`` its oldest
  entries are dropped, and with them the instance from those blocks' holders. The slack
  (1.25) makes the rule "certainly evicted": token counts are estimated from characters
  (the simulated tokenizer gives ~5.5 characters per token on the benchmark text, Llama
  3 ~4), so a block is forgotten only when even a generous estimate says it is gone.
* Capacities come from the engines (``vllm:cache_config_info``, llama.cpp ``/props``;
  see router/kvcapacity.py) through ``set_capacity``; an instance with none learned is
  bounded only by ``max_entries``.
* Only instances with a known capacity get an LRU model (memory: one more entry per
  block and holder); blocks recorded before the capacity was learned are bounded by
  ``max_entries`` only. Tails shorter than ``MIN_TAIL`` (16) tokens are not modelled.
* ``max_entries`` bounds the whole index (blocks of all instances; the oldest block is
  dropped first), ``max_holders`` the instances kept per block (the oldest holder goes).

The ``prefix_aware`` policy asks it for the deepest block each instance still holds
(``depths``): the uncached part of a prompt on that instance, which predicts its TTFT.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["CAPACITY_SLACK", "CapacityIndex"]

CAPACITY_SLACK = 1.25
# A request's tail (unhashed prompt + output) shorter than this is not modelled: it
# bounds the anonymous entries to capacity / MIN_TAIL per instance.
MIN_TAIL = 16


class CapacityIndex:
    """Block hash -> holders, with each holder's KV LRU modelled (see the module header)."""

    def __init__(self, max_entries: int, max_holders: int) -> None:
        self.max_entries = max_entries
        self.max_holders = max_holders
        # block -> holders, oldest first; the dict's order is the global LRU of blocks.
        self._d: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        # instance -> entry -> tokens (oldest first); anonymous entries are negative ints.
        self._lru: dict[str, OrderedDict[int, int]] = {}
        self._used: dict[str, int] = {}
        self._cap: dict[str, int] = {}
        self._anon = 0
        self.evicted_blocks = 0
        # instance -> (instance,): the holders of every block it alone holds, one shared
        # tuple (a new block then allocates nothing the cyclic GC tracks).
        self._one: dict[str, tuple[str]] = {}

    def __len__(self) -> int:
        return len(self._d)

    def capacity(self, instance_id: str) -> int | None:
        """The KV capacity learned for an instance, in tokens (None: not known)."""
        return self._cap.get(instance_id)

    def set_capacity(self, instance_id: str, tokens: int | None) -> None:
        """Learn (or forget, with None) an instance's KV capacity; applies at once."""
        if tokens is None or tokens <= 0:
            self._cap.pop(instance_id, None)
            return
        if self._cap.get(instance_id) != tokens:
            self._cap[instance_id] = tokens
            self._trim(instance_id)

    def used(self, instance_id: str) -> int:
        """Tokens the model believes the instance's cache holds (referenced or not)."""
        return self._used.get(instance_id, 0)

    def longest(self, chain: Sequence[int]) -> tuple[int, tuple[str, ...]]:
        """(number of leading blocks known, their holders); (0, ()) for a cold chain."""
        d = self._d
        for j in range(len(chain) - 1, -1, -1):
            holders = d.get(chain[j])
            if holders is not None:
                return j + 1, holders
        return 0, ()

    def holders(self, block: int) -> tuple[str, ...]:
        """The instances believed to hold ``block`` (oldest first; () if none)."""
        return self._d.get(block, ())

    def depths(self, chain: Sequence[int]) -> dict[str, int]:
        """For each instance holding a leading part of ``chain``: how many blocks.

        A holder of block j holds blocks 0..j (the engine's chained hashes make a block
        reachable only through its parents; the model drops the deepest blocks first).
        """
        d = self._d
        out: dict[str, int] = {}
        for j in range(len(chain) - 1, -1, -1):
            holders = d.get(chain[j])
            if holders is not None:
                for h in holders:
                    if h not in out:
                        out[h] = j + 1
        return out

    def record(
        self,
        chain: Sequence[int],
        instance_id: str,
        block_tokens: Sequence[int] | None = None,
        tail_tokens: int = 0,
    ) -> None:
        """Note that ``instance_id`` computed (or reused) every block of ``chain``.

        ``block_tokens[i]`` is block i's size in tokens (None: not weighed, so only
        ``max_entries`` bounds them); ``tail_tokens`` the rest of the request (the
        prompt past the hashed prefix plus its output).
        """
        d = self._d
        get = d.get
        move = d.move_to_end
        cap = self.max_holders
        one = self._one.get(instance_id)
        if one is None:
            one = self._one[instance_id] = (instance_id,)
        lru = None
        if instance_id in self._cap:
            lru = self._lru.get(instance_id)
            if lru is None:
                lru = self._lru[instance_id] = OrderedDict()
        # Deepest block first, so the root is the most recently used (evicted last).
        if lru is None:
            for i in range(len(chain) - 1, -1, -1):
                h = chain[i]
                cur = get(h)
                if cur is None:
                    d[h] = one
                    continue
                if instance_id not in cur:
                    if len(cur) >= cap:
                        self._drop_holder(h, cur[0])
                        cur = cur[1:]
                    d[h] = (*cur, instance_id)
                move(h)
        else:
            used = self._used.get(instance_id, 0)
            if tail_tokens >= MIN_TAIL:
                self._anon -= 1
                lru[self._anon] = tail_tokens
                used += tail_tokens
            lmove = lru.move_to_end
            for i in range(len(chain) - 1, -1, -1):
                h = chain[i]
                cur = get(h)
                if cur is not None and instance_id in cur:
                    move(h)
                    try:
                        lmove(h)
                        continue
                    except KeyError:  # recorded while the capacity was unknown
                        pass
                elif cur is None:
                    d[h] = one
                else:
                    if len(cur) >= cap:
                        self._drop_holder(h, cur[0])
                        cur = cur[1:]
                    d[h] = (*cur, instance_id)
                    move(h)
                # Not a holder before, so not in its LRU (every path that drops a
                # holder drops the block from its LRU too).
                t = block_tokens[i] if block_tokens is not None else 0
                lru[h] = t
                used += t
            self._used[instance_id] = used
            if used > self._cap[instance_id] * CAPACITY_SLACK:
                self._trim(instance_id)
        if len(d) > self.max_entries:
            while len(d) > self.max_entries:
                h, holders = d.popitem(last=False)
                for x in holders:
                    self._unlink(x, h)

    def forget(self, instance_id: str) -> None:
        """Drop an instance that left the variant from every entry."""
        lru = self._lru.pop(instance_id, None)
        self._used.pop(instance_id, None)
        self._one.pop(instance_id, None)
        if lru is None:
            return
        for h in lru:
            if h >= 0:
                self._remove_holder(h, instance_id)

    def clear(self, instance_id: str) -> None:
        """The instance's cache was emptied (restart, reset): it holds nothing now."""
        cap = self._cap.get(instance_id)
        self.forget(instance_id)
        if cap is not None:
            self._cap[instance_id] = cap

    # --- internals ----------------------------------------------------------------------

    def _trim(self, instance_id: str) -> None:
        cap = self._cap.get(instance_id)
        if cap is None:
            return
        limit = cap * CAPACITY_SLACK
        used = self._used.get(instance_id, 0)
        if used <= limit:
            return
        lru = self._lru.get(instance_id)
        if lru is None:
            return
        d = self._d
        pop = lru.popitem
        evicted = 0
        while used > limit and lru:
            h, t = pop(last=False)
            used -= t
            if h >= 0:
                evicted += 1
                cur = d.get(h)
                if cur is None or instance_id not in cur:
                    continue
                if len(cur) == 1:
                    del d[h]
                else:
                    i = cur.index(instance_id)
                    d[h] = cur[:i] + cur[i + 1 :]
        self.evicted_blocks += evicted
        self._used[instance_id] = used

    def _remove_holder(self, h: int, instance_id: str) -> None:
        cur = self._d.get(h)
        if cur is None or instance_id not in cur:
            return
        if len(cur) == 1:
            del self._d[h]
            return
        # Holders are distinct: dropping the one occurrence keeps the others' order.
        i = cur.index(instance_id)
        self._d[h] = cur[:i] + cur[i + 1 :]

    def _drop_holder(self, h: int, instance_id: str) -> None:
        """``instance_id`` is no longer a holder of block ``h`` (too many holders)."""
        self._unlink(instance_id, h)

    def _unlink(self, instance_id: str, h: int) -> None:
        lru = self._lru.get(instance_id)
        if lru is not None:
            t = lru.pop(h, None)
            if t is not None:
                self._used[instance_id] -= t
