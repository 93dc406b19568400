"""The precise KV index: which blocks each instance holds, from its KV events (pure).

An engine started with KV events (vLLM ``--kv-events-config``, the simulated engine's
``--kv-events``) announces every block it stores or evicts (engine/kvevents.py has the
wire format). ``PreciseIndex`` applies those batches to one set of block hashes per
instance and answers, for a prompt, how many of its leading blocks each instance holds.

* **Hashes.** A prompt is tokenized and hashed exactly as the simulated engine does it,
  with the engine's own code: ``render_chat`` for chat messages, its ``Tokenizer``, and
  ``kvcache.block_hashes`` (chained, per full block of ``block_size`` tokens, the
  request's ``cache_salt`` starting the chain).
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
* **Silence.** ``sent`` marks an instance as owing events when a prompt it was sent has
  full blocks the set lacks (the engine will store them); any batch clears that. The
  adapter times how long the mark stays (this module reads no clock).

Two routers fed the same stream hold the same sets (``digest`` compares them).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from preheat.engine.core.chat import render_chat
from preheat.engine.core.tokenizer import Tokenizer
from preheat.errors import ConfigError
from preheat.kvcache import DEFAULT_BLOCK_SIZE, block_hashes

__all__ = ["STATES", "InstanceBlocks", "Lookup", "PreciseIndex", "prompt_tokens"]

STATES = ("waiting", "synced", "fallback")
MAX_PENDING = 4096
_TOKENIZER = Tokenizer()


def prompt_tokens(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids as the simulated engine computes them (None: no prompt)."""
    msgs = body.get("messages")
    if msgs is not None:
        try:
            return _TOKENIZER.encode(render_chat(msgs, body.get("tools")))
        except ConfigError:
            return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _TOKENIZER.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return list(prompt)
    return None


@dataclass(slots=True)
class InstanceBlocks:
    """One instance's announced blocks and how far they can be trusted."""

    blocks: set[int] = field(default_factory=set)
    state: str = "waiting"
    reason: str = "no event received yet"
    last_seq: int = -1
    # Sent, not yet announced (insertion order: the oldest first).
    pending: dict[int, None] = field(default_factory=dict)
    owes_events: bool = False
    batches: int = 0
    gaps: int = 0


@dataclass(frozen=True, slots=True)
class Lookup:
    """A prompt's block hashes, and the leading blocks each synced instance holds."""

    hashes: tuple[int, ...]
    num_tokens: int
    block_size: int
    held: Mapping[str, int]
    synced: frozenset[str]

    def held_chars(self, prompt_chars: int) -> dict[str, int]:
        """The held tokens of each synced instance as prompt characters (pro rata)."""
        per = prompt_chars / max(self.num_tokens, 1)
        return {x: int(n * self.block_size * per) for x, n in self.held.items()}


class PreciseIndex:
    """Per-instance block-hash sets fed by KV event batches (see the module header)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.instances: dict[str, InstanceBlocks] = {}

    def add(self, instance_id: str) -> None:
        self.instances.setdefault(instance_id, InstanceBlocks())

    def remove(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)

    def state(self, instance_id: str) -> str | None:
        ib = self.instances.get(instance_id)
        return ib.state if ib is not None else None

    def apply(self, instance_id: str, seq: int, events: Sequence[Any]) -> None:
        """Apply one EventBatch's events, received with sequence number ``seq``."""
        ib = self.instances.get(instance_id)
        if ib is None:
            return
        ib.batches += 1
        ib.owes_events = False
        if seq == 0 and ib.last_seq >= 0:
            # The publisher restarted (a new engine): its cache starts empty.
            ib.blocks.clear()
            self._sync(ib, "publisher restarted (sequence 0)")
        elif seq == 0:
            self._sync(ib, "first batch of the publisher")
        elif ib.last_seq >= 0 and seq != ib.last_seq + 1:
            ib.gaps += 1
            self._fall_back(ib, f"sequence gap: {ib.last_seq} then {seq}")
        elif ib.last_seq < 0:
            self._fall_back(ib, f"joined the stream at sequence {seq}: earlier events missed")
        ib.last_seq = seq
        for ev in events:
            if not isinstance(ev, list | tuple) or not ev:
                continue
            kind = ev[0]
            if kind == "AllBlocksCleared":
                ib.blocks.clear()
                self._sync(ib, "AllBlocksCleared")
            elif ib.state != "synced":
                continue
            elif kind == "BlockStored" and len(ev) > 1:
                ib.blocks.update(ev[1])
                if ib.pending:
                    for h in ev[1]:
                        ib.pending.pop(h, None)
            elif kind == "BlockRemoved" and len(ev) > 1:
                ib.blocks.difference_update(ev[1])

    def lost(self, instance_id: str, reason: str) -> None:
        """The adapter lost the stream (disconnect, silence): fall back until a resync."""
        ib = self.instances.get(instance_id)
        if ib is not None and ib.state == "synced":
            self._fall_back(ib, reason)

    def lookup(self, body: Mapping[str, Any] | None, ids: Collection[str]) -> Lookup | None:
        """Held leading blocks of the prompt on each synced instance of ``ids``; None if no
        instance of ``ids`` is synced or the body has no prompt to tokenize."""
        inst = self.instances
        synced = frozenset(x for x in ids if (ib := inst.get(x)) and ib.state == "synced")
        if not synced or body is None:
            return None
        tokens = prompt_tokens(body)
        if tokens is None:
            return None
        salt = body.get("cache_salt")
        hashes = block_hashes(tokens, self.block_size, salt=salt if isinstance(salt, str) else None)
        held: dict[str, int] = {}
        for x in synced:
            blocks = inst[x].blocks
            pending = inst[x].pending
            n = 0
            for h in hashes:
                if h not in blocks and h not in pending:
                    break
                n += 1
            held[x] = n
        return Lookup(tuple(hashes), len(tokens), self.block_size, held, synced)

    def sent(self, instance_id: str, lookup: Lookup) -> None:
        """The prompt of ``lookup`` went to ``instance_id``: it owes events if it lacks some
        of the prompt's full blocks (the engine will store them)."""
        ib = self.instances.get(instance_id)
        if (
            ib is not None
            and ib.state == "synced"
            and lookup.held.get(instance_id, 0) < len(lookup.hashes)
        ):
            ib.owes_events = True
            pending = ib.pending
            for h in lookup.hashes[lookup.held.get(instance_id, 0) :]:
                if h not in ib.blocks:
                    pending[h] = None
            while len(pending) > MAX_PENDING:
                del pending[next(iter(pending))]

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
        """Per instance: state, reason, blocks held, batches, gaps, last sequence number."""
        return {
            x: {
                "state": ib.state,
                "reason": ib.reason,
                "blocks": len(ib.blocks),
                "batches": ib.batches,
                "gaps": ib.gaps,
                "last_seq": ib.last_seq,
                "digest": f"{self.digest(x):016x}",
            }
            for x, ib in self.instances.items()
        }

    @staticmethod
    def _sync(ib: InstanceBlocks, reason: str) -> None:
        ib.state = "synced"
        ib.reason = reason
        ib.pending.clear()

    @staticmethod
    def _fall_back(ib: InstanceBlocks, reason: str) -> None:
        ib.state = "fallback"
        ib.reason = reason
        ib.blocks.clear()
        ib.pending.clear()
        ib.owes_events = False
