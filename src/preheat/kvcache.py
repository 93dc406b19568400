"""A block-level prefix KV cache with vLLM's automatic-prefix-caching semantics.

Pure: no I/O, no clock. The simulated engine, the fleet simulator and the tests all use
this one implementation.

Model (vLLM v1 ``KVCacheManager`` / ``BlockPool``):

* The cache has a fixed number of blocks, each holding ``block_size`` tokens (16).
* A *full* block is identified by a hash chained over the previous block's hash and the
  block's own token ids (:func:`block_hashes`), so the same 16 tokens after a different
  prefix are a different block. Partial (trailing) blocks are never shared.
* A new sequence looks up its leading full blocks; the longest run of consecutive hits is
  reused. As in vLLM at least one prompt token is always computed (the last one produces
  the logits), so a fully cached prompt reuses all but its final block.
* Blocks in use by running sequences carry a reference count and cannot be evicted. When
  a sequence ends its blocks go to a free queue (tail blocks first, so a sequence's end is
  evicted before its shareable start); a block keeps its contents and its hash while it
  sits there, so a later request can still hit it. Allocation takes the least recently
  freed block and, if it held a cached block, drops that hash (LRU eviction).
* Counters follow vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``: tokens looked
  up and tokens found, counted once per admitted sequence.

Typical use by a scheduler::

    hashes = kv.hashes(prompt_tokens)
    cached = kv.allocate_prompt(seq_id, hashes, len(prompt_tokens), first_chunk_end)
    if cached is None: ...                     # not enough free blocks: stay waiting
    kv.grow(seq_id, num_tokens)                # before each further chunk / decode step
    kv.commit(seq_id, hashes, computed_tokens) # after a step: full computed blocks become hits
    kv.free(seq_id)                            # finished, aborted or preempted
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "KVCache",
    "KVCacheStats",
    "block_hashes",
    "root_hash",
]

DEFAULT_BLOCK_SIZE = 16
_ROOT = 0x5EED_0F_B10C  # the parent of the first block when no salt is given


def root_hash(salt: str | None = None) -> int:
    """The chain's starting value; a ``cache_salt`` (vLLM) gives a disjoint chain."""
    if not salt:
        return _ROOT
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def block_hashes(
    tokens: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    parent: int | None = None,
    salt: str | None = None,
) -> list[int]:
    """Chained hashes of every *full* block of ``tokens``.

    ``hash((parent, block_tokens))`` over ints is deterministic across processes (Python
    randomises only str/bytes hashing), fast, and 64-bit wide. Pass ``parent`` to extend
    an existing chain (hashes of generated tokens appended to a prompt's).
    """
    h = root_hash(salt) if parent is None else parent
    out = []
    n_full = len(tokens) // block_size
    for i in range(n_full):
        h = hash((h, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the cache's counters and occupancy."""

    num_blocks: int
    block_size: int
    free_blocks: int
    """Blocks not referenced by any running sequence (cached or empty)."""
    cached_blocks: int
    """Blocks holding a hashed, reusable prefix (referenced or not)."""
    queries: int
    """Prompt tokens looked up (vLLM ``prefix_cache_queries``)."""
    hits: int
    """Prompt tokens found cached (vLLM ``prefix_cache_hits``)."""
    evictions: int
    """Cached blocks dropped to make room."""

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (vLLM ``kv_cache_usage_perc``)."""
        return 1.0 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCache:
    """Fixed-capacity block pool with a chained-hash prefix index and LRU eviction."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks {num_blocks} must be at least 1")
        if block_size < 1:
            raise ValueError(f"block_size {block_size} must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Unreferenced blocks, in the order allocation takes them (vLLM's free queue):
        # emptied blocks, most recently freed first; then blocks never used, in id order;
        # then blocks that still hold a cached prefix (or held one before ``reset``), least
        # recently freed first. Three parts instead of one queue of every block, so a pool
        # of a million blocks costs nothing until it is used and ``free`` is cheap.
        self._empty: list[int] = []
        self._fresh = 0  # blocks ``_fresh`` .. ``num_blocks - 1`` were never used
        self._cached: OrderedDict[int, None] = OrderedDict()
        # seq id -> its block ids in order, and how many of them are registered as cached.
        self._seqs: dict[Hashable, list[int]] = {}
        self._committed: dict[Hashable, int] = {}
        self.queries = 0
        self.hits = 0
        self.evictions = 0
        # With a list here, every change of the prefix index is appended to it, in
        # order, for a KV-event publisher (vLLM's BlockStored / BlockRemoved /
        # AllBlocksCleared): ("stored", seq_id, block index, hash, parent hash or None),
        # ("removed", hash), ("cleared",). None (the default) records nothing.
        self.events: list[tuple[object, ...]] | None = None

    # --- queries ------------------------------------------------------------------------

    def hashes(self, tokens: Sequence[int], *, salt: str | None = None) -> list[int]:
        """:func:`block_hashes` with this cache's block size."""
        return block_hashes(tokens, self.block_size, salt=salt)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def match(self, hashes: Sequence[int], num_prompt_tokens: int | None = None) -> int:
        """Cached leading blocks for these hashes, with no side effects.

        With ``num_prompt_tokens``, the match is capped so at least one prompt token is
        left to compute (vLLM recomputes the last token of a fully cached prompt).
        """
        if not self.enable_prefix_caching:
            return 0
        limit = len(hashes)
        if num_prompt_tokens is not None:
            limit = min(limit, (num_prompt_tokens - 1) // self.block_size)
        n = 0
        by_hash = self._by_hash
        while n < limit and hashes[n] in by_hash:
            n += 1
        return n

    def cached_tokens(self, hashes: Sequence[int], num_prompt_tokens: int) -> int:
        """Tokens a new sequence with this prompt would reuse right now (no side effects)."""
        return self.match(hashes, num_prompt_tokens) * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._empty) + self.num_blocks - self._fresh + len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.free_blocks / self.num_blocks

    def seq_blocks(self, seq_id: Hashable) -> int:
        """Blocks currently held by a sequence (0 if unknown)."""
        return len(self._seqs.get(seq_id, ()))

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_blocks=self.free_blocks,
            cached_blocks=len(self._by_hash),
            queries=self.queries,
            hits=self.hits,
            evictions=self.evictions,
        )

    def can_allocate_prompt(
        self, hashes: Sequence[int], num_prompt_tokens: int, num_tokens: int
    ) -> bool:
        """Whether :meth:`allocate_prompt` would succeed now."""
        hit = self.match(hashes, num_prompt_tokens)
        return self._blocks_needed_new(hashes, hit, num_tokens) <= self.free_blocks

    # --- mutations ----------------------------------------------------------------------

    def allocate_prompt(
        self,
        seq_id: Hashable,
        hashes: Sequence[int],
        num_prompt_tokens: int,
        num_tokens: int,
        *,
        hit: int | None = None,
    ) -> int | None:
        """Start a sequence: reuse its cached prefix and reserve slots for ``num_tokens``.

        ``num_tokens`` is how many tokens the sequence will have computed after its first
        step (cached prefix plus the first prefill chunk). Returns the number of cached
        prompt tokens, or ``None`` with nothing changed if the free blocks do not suffice.
        Counts the lookup in ``queries`` / ``hits`` only when it succeeds. ``hit``: what
        ``match(hashes, num_prompt_tokens)`` returned with no change to the cache since
        (the scheduler has just asked), so the lookup is not repeated.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it first")
        if hit is None:
            hit = self.match(hashes, num_prompt_tokens)
        num_tokens = max(num_tokens, hit * self.block_size)
        blocks = list(map(self._by_hash.__getitem__, hashes[:hit]))
        ref = self._ref
        evictable = list(map(ref.__getitem__, blocks)).count(0)
        new = self.blocks_for(num_tokens) - hit
        if new + evictable > self.free_blocks:
            return None
        if evictable:
            cached = self._cached
            for b in blocks:
                if ref[b] == 0:
                    del cached[b]
                ref[b] += 1
        else:
            for b in blocks:
                ref[b] += 1
        self._seqs[seq_id] = blocks
        self._committed[seq_id] = hit
        self._take(blocks, new)
        self.queries += num_prompt_tokens
        self.hits += hit * self.block_size
        return hit * self.block_size

    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make the sequence hold slots for ``num_tokens`` tokens; False (no change) if full."""
        blocks = self._seqs[seq_id]
        need = self.blocks_for(num_tokens) - len(blocks)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        self._take(blocks, need)
        return True

    def commit(self, seq_id: Hashable, hashes: Sequence[int], num_computed_tokens: int) -> None:
        """Register the sequence's full, computed blocks so later requests can hit them.

        ``hashes`` are the sequence's full-block hashes (prompt and, if known, output).
        A block whose hash is already cached elsewhere stays private (vLLM keeps one
        canonical block per hash).
        """
        if not self.enable_prefix_caching:
            return
        done = self._committed[seq_id]
        upto = num_computed_tokens // self.block_size
        if upto <= done:
            return  # no new full block (a decode step inside a block)
        blocks = self._seqs[seq_id]
        upto = min(upto, len(hashes), len(blocks))
        by_hash = self._by_hash
        hashed = self._hash
        events = self.events
        for i in range(done, upto):
            h = hashes[i]
            b = blocks[i]
            if h not in by_hash and hashed[b] is None:
                by_hash[h] = b
                hashed[b] = h
                if events is not None:
                    events.append(("stored", seq_id, i, h, hashes[i - 1] if i else None))
        if upto > done:
            self._committed[seq_id] = upto

    def free(self, seq_id: Hashable) -> int:
        """Release a sequence's blocks (finished, aborted or preempted); returns how many.

        Unreferenced blocks join the free queue tail-first, so the sequence's last blocks
        are evicted before its (more shareable) first ones. Unknown ids are ignored.
        """
        blocks = self._seqs.pop(seq_id, None)
        self._committed.pop(seq_id, None)
        if blocks is None:
            return 0
        ref = self._ref
        hashed = self._hash
        cached = self._cached
        empty = self._empty
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r:
                continue
            if hashed[b] is None:
                # Empty blocks go to the front: reuse them before evicting cached ones.
                empty.append(b)
            else:
                cached[b] = None
        return len(blocks)

    def reset(self) -> None:
        """Drop every cached prefix that no running sequence holds (vLLM ``reset_prefix_cache``)."""
        for b in self._cached:
            h = self._hash[b]
            if h is not None:
                del self._by_hash[h]
                self._hash[b] = None
        if self.events is not None:
            # Blocks running sequences still hold stay cached but go unannounced: a
            # subscriber under-counts them until they are stored again (conservative).
            self.events.append(("cleared",))

    # --- internals ----------------------------------------------------------------------

    def _blocks_needed_new(self, hashes: Sequence[int], hit: int, num_tokens: int) -> int:
        # Hit blocks that are currently free leave the free queue when pinned, so they count
        # against the free blocks exactly like new ones (vLLM: num_evictable_computed_blocks).
        held = map(self._by_hash.__getitem__, hashes[:hit])
        evictable_hits = list(map(self._ref.__getitem__, held)).count(0)
        new = max(0, self.blocks_for(max(num_tokens, hit * self.block_size)) - hit)
        return new + evictable_hits

    def _take(self, blocks: list[int], n: int) -> None:
        # The caller checked ``n <= free_blocks``; take them in the free queue's order.
        ref = self._ref
        empty = self._empty
        k = min(n, len(empty))
        if k:
            taken = empty[-k:]
            del empty[-k:]
            taken.reverse()
            for b in taken:
                ref[b] = 1
            blocks.extend(taken)
            n -= k
        k = min(n, self.num_blocks - self._fresh)
        if k:
            start = self._fresh
            self._fresh = start + k
            ref[start : start + k] = [1] * k
            blocks.extend(range(start, start + k))
            n -= k
        cached = self._cached
        for _ in range(n):
            b, _none = cached.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                del self._by_hash[h]
                self._hash[b] = None
                self.evictions += 1
                if self.events is not None:
                    self.events.append(("removed", h))
            self._ref[b] = 1
            blocks.append(b)
