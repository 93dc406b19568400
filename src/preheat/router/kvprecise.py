"""The precise KV index: which blocks each instance holds, from its KV events (pure).

An engine started with KV events (vLLM ``--kv-events-config``, the simulated engine's
``--kv-events``) announces every block it stores or evicts (engine/kvevents.py has the
wire format). ``PreciseIndex`` applies those batches to one set of block hashes per
instance and answers, for a prompt, how many of its leading blocks each instance holds.

* **Hashes.** A prompt is tokenized and hashed exactly as its instance's engine does it
  (router/kvprompt.py, cached by chunk): by default the simulated engine's template,
  tokenizer and ``builtin`` hash; per instance a model's ``tokenizer.json`` and vLLM's
  ``sha256``/``sha256_cbor`` chain (router/kvspec.py, preheat/kvhash.py). Instances
  with the same codec, scheme and block size share one computation per request.
* **Lookup cost.** Each block hash maps to a bitmask of the instances that announced it
  or have it pending (the two sets are disjoint); a prompt's held run per instance is a running
  AND of its blocks' masks, stopped at the first block no instance holds: one dict
  probe per matched block, whatever the number of instances.
* **Trust.** An instance is ``synced`` (its set is what the engine holds) only after a
  batch with sequence number 0 (the publisher's first) or one holding
  ``AllBlocksCleared``. A sequence gap (a lost message) or ``lost`` (the adapter saw the
  publisher disconnect or fall silent) makes it ``fallback``: the policy uses the
  learned index for it until a fresh ``AllBlocksCleared`` (e.g. ``POST
  /reset_prefix_cache``) or a restarted publisher (sequence 0) resyncs it. ``waiting``:
  nothing received yet.
* **In flight.** Blocks of a prompt sent to an instance but not yet announced (the
  engine stores a block only when its prefill is done) count as held there, so a burst
  of requests on one new prefix is not spread over the fleet before the first
  ``BlockStored`` arrives. They leave that set when announced, and the oldest go past
  ``MAX_PENDING`` (4,096 per instance: blocks of a request that failed). They are this
  router's own and not part of ``digest``.
* **Deferred pending.** ``sent`` only queues (instance, the prompt's blocks past its
  held run); the pending marks are written when the index is next read or written
  (``lookup``, ``apply``, ``add``, ``remove``, ``lost``) or on ``flush``, in the order
  sent, so every result is what marking them at once gives (the pending set and masks
  are read nowhere else). A decision no longer walks the prompt's new blocks.
* **Silence.** ``sent`` marks an instance as owing events when a prompt it was sent has
  full blocks the set lacks (the engine will store them); any batch clears that. The
  adapter times how long the mark stays (this module reads no clock).

Two routers fed the same stream hold the same sets (``digest`` compares them).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from preheat.kvhash import HashScheme, external_hash
from preheat.router.kvlookup import Lookup, RunsHeld
from preheat.router.kvprompt import EngineCodec, PromptBlocks

__all__ = ["STATES", "InstanceBlocks", "Lookup", "PreciseIndex", "prompt_tokens"]

STATES = ("waiting", "synced", "fallback")
MAX_PENDING = 4096
DEFAULT_BLOCK_SIZE = 16
_ENGINE = EngineCodec()


def prompt_tokens(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids as the simulated engine computes them (None: no prompt)."""
    return PromptBlocks(_ENGINE, HashScheme("builtin")).tokens(body)


@dataclass(slots=True)
class InstanceBlocks:
    """One instance's announced blocks and how far they can be trusted."""

    prompt: PromptBlocks
    bit: int
    blocks: set[int] = field(default_factory=set)
    state: str = "waiting"
    reason: str = "no event received yet"
    last_seq: int = -1
    # Sent, not yet announced (insertion order: the oldest first).
    pending: dict[int, None] = field(default_factory=dict)
    owes_events: bool = False
    batches: int = 0
    gaps: int = 0


class PreciseIndex:
    """Per-instance block-hash sets fed by KV event batches (see the module header)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.default_prompt = PromptBlocks(_ENGINE, HashScheme("builtin"), block_size)
        self.instances: dict[str, InstanceBlocks] = {}
        # block hash -> bitmask of the instances that announced it or have it pending
        self._mask: dict[int, int] = {}
        self._by_bit: dict[int, str] = {}
        # Bumped whenever an instance's state or prompt changes: ``lookup`` keeps which of
        # the ids it was last given are synced (and their masks) until then.
        self._version = 0
        self._plan: Any = None
        # ``sent`` calls whose pending marks are not written yet: (instance, the prompt's
        # hashes, blocks it held), oldest first (module header, "Deferred pending").
        self._owed: list[tuple[InstanceBlocks, tuple[int, ...], int]] = []

    def add(self, instance_id: str, prompt: PromptBlocks | None = None) -> None:
        """Track ``instance_id``; ``prompt``: how its engine hashes prompts (default: the
        simulated engine's). A changed ``prompt`` drops what was learned."""
        if self._owed:
            self.flush()
        prompt = prompt or self.default_prompt
        self._version += 1
        ib = self.instances.get(instance_id)
        if ib is not None:
            if ib.prompt.key == prompt.key:
                ib.prompt = prompt
                return
            self._fall_back(ib, "the instance's tokenizer or hash changed")
            ib.state, ib.reason, ib.last_seq = "waiting", "no event received yet", -1
            ib.prompt = prompt
            return
        bit = 1
        while bit in self._by_bit:
            bit <<= 1
        self._by_bit[bit] = instance_id
        self.instances[instance_id] = InstanceBlocks(prompt, bit)

    def remove(self, instance_id: str) -> None:
        if self._owed:
            self.flush()
        ib = self.instances.pop(instance_id, None)
        self._version += 1
        if ib is not None:
            self._drop(ib)
            del self._by_bit[ib.bit]

    def state(self, instance_id: str) -> str | None:
        ib = self.instances.get(instance_id)
        return ib.state if ib is not None else None

    def apply(self, instance_id: str, seq: int, events: Sequence[Any]) -> None:
        """Apply one EventBatch's events, received with sequence number ``seq``."""
        if self._owed:
            self.flush()
        ib = self.instances.get(instance_id)
        if ib is None:
            return
        ib.batches += 1
        ib.owes_events = False
        if seq == 0 and ib.last_seq >= 0:
            # The publisher restarted (a new engine): its cache starts empty.
            self._drop(ib)
            self._sync(ib, "publisher restarted (sequence 0)")
        elif seq == 0:
            self._sync(ib, "first batch of the publisher")
        elif ib.last_seq >= 0 and seq != ib.last_seq + 1:
            ib.gaps += 1
            self._fall_back(ib, f"sequence gap: {ib.last_seq} then {seq}")
        elif ib.last_seq < 0:
            self._fall_back(ib, f"joined the stream at sequence {seq}: earlier events missed")
        ib.last_seq = seq
        mask, bit = self._mask, ib.bit
        for ev in events:
            if not isinstance(ev, (list, tuple)) or not ev:
                continue
            kind = ev[0]
            if kind == "AllBlocksCleared":
                self._drop(ib)
                self._sync(ib, "AllBlocksCleared")
            elif ib.state != "synced" or len(ev) < 2 or not isinstance(ev[1], (list, tuple)):
                continue
            elif kind == "BlockStored":
                for raw in ev[1]:
                    h = external_hash(raw)
                    if h is None or h in ib.blocks:
                        continue
                    ib.blocks.add(h)
                    if h in ib.pending:
                        del ib.pending[h]  # its bit stays: now announced
                    else:
                        mask[h] = mask.get(h, 0) | bit
            elif kind == "BlockRemoved":
                for raw in ev[1]:
                    h = external_hash(raw)
                    if h is not None and h in ib.blocks:
                        ib.blocks.discard(h)
                        self._clear(h, bit)

    def lost(self, instance_id: str, reason: str) -> None:
        """The adapter lost the stream (disconnect, silence): fall back until a resync."""
        if self._owed:
            self.flush()
        ib = self.instances.get(instance_id)
        if ib is not None and ib.state == "synced":
            self._fall_back(ib, reason)

    def lookup(self, body: Mapping[str, Any] | None, ids: Collection[str]) -> Lookup | None:
        """Held leading blocks of the prompt on each synced instance of ``ids``; None if no
        instance of ``ids`` is synced or the body has no prompt to tokenize."""
        if body is None:
            return None
        if self._owed:
            self.flush()
        synced, masks, zeros, synced_set = self._synced_of(ids)
        if not synced:
            return None
        if len(masks) == 1:
            return self._lookup_one(body, masks[0], zeros, synced_set)
        held_n: dict[str, int] = {}
        group: dict[str, int] = {}
        groups: list[tuple[tuple[int, ...], int, int]] = []
        held, by_bit = self._mask, self._by_bit
        for pb, mask in masks:
            got = pb.blocks(body)
            if got is None:
                continue
            hashes, ntok = got
            gi = len(groups)
            groups.append((tuple(hashes), ntok, pb.block_size))
            cur = mask
            for j, h in enumerate(hashes):
                m = held.get(h, 0) & cur
                if m != cur:
                    gone = cur & ~m
                    while gone:
                        low = gone & -gone
                        x = by_bit[low]
                        held_n[x] = j
                        group[x] = gi
                        gone ^= low
                    cur = m
                    if not cur:
                        break
            while cur:
                low = cur & -cur
                x = by_bit[low]
                held_n[x] = len(hashes)
                group[x] = gi
                cur ^= low
        if not groups:
            return None
        h0, n0, b0 = groups[0]
        return Lookup(h0, n0, b0, held_n, frozenset(group), tuple(groups), group)

    def _lookup_one(
        self,
        body: Mapping[str, Any],
        pb_mask: tuple[PromptBlocks, int],
        zeros: dict[str, int],
        synced: frozenset[str],
    ) -> Lookup | None:
        """``lookup`` when every synced instance reads prompts one way (one group): the
        held counts as runs (router/kvlookup.py), nothing written per instance."""
        pb, mask = pb_mask
        got = pb.blocks(body)
        if got is None:
            return None
        hashes, ntok = got
        held = self._mask
        runs: list[tuple[int, int]] = []
        cur = mask
        for j, h in enumerate(hashes):
            m = held.get(h, 0) & cur
            if m != cur:
                if j:
                    runs.append((j, cur & ~m))
                cur = m
                if not cur:
                    break
        if cur:
            runs.append((len(hashes), cur))
        runs.reverse()
        rs = tuple(runs)
        plan = self._plan
        by_bit, bits = plan[6], plan[7]
        t = tuple(hashes)
        return Lookup(
            t,
            ntok,
            pb.block_size,
            RunsHeld(zeros, rs, by_bit),
            synced,
            ((t, ntok, pb.block_size),),
            zeros,
            rs,
            by_bit,
            bits,
        )

    def _synced_of(
        self, ids: Collection[str]
    ) -> tuple[list[str], list[tuple[PromptBlocks, int]], dict[str, int], frozenset[str]]:
        """The synced instances of ``ids``; per prompt codec the bitmask of its synced
        instances (in order of first appearance); each synced instance mapped to 0, and
        their set. Kept until ``ids`` or a state changes (read-only to callers)."""
        key = ids if isinstance(ids, tuple) else tuple(ids)
        plan = self._plan
        if plan is not None and plan[1] == self._version and plan[0] == key:
            return plan[2], plan[3], plan[4], plan[5]
        inst = self.instances
        masks: dict[int, tuple[PromptBlocks, int]] = {}
        synced = []
        for x in key:
            ib = inst.get(x)
            if ib is not None and ib.state == "synced":
                synced.append(x)
                k = id(ib.prompt)
                pb_mask = masks.get(k)
                masks[k] = (ib.prompt, (pb_mask[1] if pb_mask else 0) | ib.bit)
        out = list(masks.values())
        zeros = dict.fromkeys(synced, 0)
        fs = frozenset(synced)
        # bit -> synced instance and back, for lookups' runs (a snapshot of this plan).
        bits = {x: inst[x].bit for x in synced}
        by_bit = {b: x for x, b in bits.items()}
        self._plan = (key, self._version, synced, out, zeros, fs, by_bit, bits)
        return synced, out, zeros, fs

    def sent(self, instance_id: str, lookup: Lookup) -> None:
        """The prompt of ``lookup`` went to ``instance_id``: it owes events if it lacks some
        of the prompt's full blocks (the engine will store them), and those blocks are
        pending there (written at the next ``flush``; module header)."""
        ib = self.instances.get(instance_id)
        if ib is None or ib.state != "synced" or instance_id not in lookup.group:
            return
        hashes = lookup.hashes_of(instance_id)
        have = lookup.held_of(instance_id)
        if have >= len(hashes):
            return
        ib.owes_events = True
        self._owed.append((ib, hashes, have))

    def flush(self) -> None:
        """Write the pending marks ``sent`` queued, oldest first. Every call that changes
        an instance's state or blocks flushes first, so each instance is as ``sent`` saw
        it (tracked and synced) and the marks are those ``sent`` would have written."""
        owed, self._owed = self._owed, []
        mask = self._mask
        for ib, hashes, have in owed:
            pending, blocks, bit = ib.pending, ib.blocks, ib.bit
            for h in hashes[have:]:
                if h not in blocks and h not in pending:
                    pending[h] = None
                    mask[h] = mask.get(h, 0) | bit
            while len(pending) > MAX_PENDING:
                h = next(iter(pending))
                del pending[h]
                self._clear(h, bit)

    def digest(self, instance_id: str) -> int:
        """An order-free fingerprint of an instance's block set (equal sets, equal digests)."""
        ib = self.instances.get(instance_id)
        if ib is None:
            return 0
        d = 0
        for h in ib.blocks:
            d ^= (h * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        return d

    def status(self) -> dict[str, dict[str, Any]]:
        """Per instance: state, reason, blocks held, batches, gaps, last sequence number,
        and the tokenizer/hash it is read with."""
        return {
            x: {
                "state": ib.state,
                "reason": ib.reason,
                "blocks": len(ib.blocks),
                "batches": ib.batches,
                "gaps": ib.gaps,
                "last_seq": ib.last_seq,
                "digest": f"{self.digest(x):016x}",
                "tokenizer": ib.prompt.codec.name,
                "hash": ib.prompt.scheme.name,
            }
            for x, ib in self.instances.items()
        }

    def _clear(self, h: int, bit: int) -> None:
        m = self._mask.get(h, 0) & ~bit
        if m:
            self._mask[h] = m
        else:
            self._mask.pop(h, None)

    def _drop(self, ib: InstanceBlocks) -> None:
        """Forget the instance's blocks and pending blocks (and their mask bits)."""
        for h in ib.blocks:
            self._clear(h, ib.bit)
        ib.blocks.clear()
        for h in ib.pending:
            self._clear(h, ib.bit)
        ib.pending.clear()

    def _sync(self, ib: InstanceBlocks, reason: str) -> None:
        ib.state = "synced"
        self._version += 1
        ib.reason = reason
        for h in ib.pending:
            self._clear(h, ib.bit)
        ib.pending.clear()

    def _fall_back(self, ib: InstanceBlocks, reason: str) -> None:
        ib.state = "fallback"
        self._version += 1
        ib.reason = reason
        self._drop(ib)
        ib.owes_events = False
