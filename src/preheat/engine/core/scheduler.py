"""Continuous batching with chunked prefill over the prefix KV cache (vLLM v1's scheduler).

Pure and clock-free: the caller supplies times. The live server runs ``schedule()``,
sleeps ``step.duration x time_scale``, then ``complete(step, now)``; the fleet simulator
does the same on virtual time; ``run_until_idle`` drives it alone on virtual time.

One step (``schedule``):

1. **Running sequences first**, oldest first. Each needs the tokens it has not computed
   yet (the rest of its prompt in chunks, or 1 token when decoding), capped by the step's
   token budget (``max_num_batched_tokens``). If the KV cache cannot hold the new slots,
   the **newest** running sequence is preempted (blocks freed, sent to the front of the
   waiting queue to be recomputed later, vLLM's "recompute" preemption) until it fits,
   or the sequence preempts itself.
2. **Then waiting sequences**, in arrival order, while budget and ``max_num_seqs`` allow
   and no sequence was preempted this step: look up the cached prefix, allocate slots
   for cached + first chunk; stop at the first that does not fit (FCFS, no skipping).
3. The step's duration comes from the profile: ``profile.step_time(StepWork(...))``.

``complete`` then advances every scheduled sequence: computed tokens grow, full blocks
are registered in the cache, a sequence that finished its prompt (or decoded) samples
one output token, and sequences that reached ``max_tokens`` finish and free their blocks.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from preheat.errors import PromptTooLong
from preheat.kvcache import KVCache, block_hashes
from preheat.timing import EngineProfile, StepWork, prefill_attn_pairs

from .tokenizer import FILLER_IDS
from .tokens import JoinedTokens

__all__ = ["Scheduler", "SeqOutput", "SeqState", "Step"]


@dataclass(eq=False)
class SeqState:
    """One request inside the engine."""

    req_id: Hashable
    prompt_tokens: Sequence[int]
    """The prompt's ids: the caller's tuple or ``JoinedTokens`` itself (immutable, so
    shared), else a copy."""
    max_tokens: int
    arrival: float
    salt: str | None = None
    output_tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens found in the prefix cache at first admission (-1: not yet admitted)."""
    hashes: list[int] = field(default_factory=list)
    first_scheduled: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    is_running: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    def all_tokens(self) -> list[int]:
        return [*self.prompt_tokens, *self.output_tokens]


@dataclass(frozen=True)
class Step:
    """A planned step: which sequences compute how many tokens, and how long it takes."""

    scheduled: tuple[tuple[SeqState, int], ...]
    work: StepWork
    duration: float
    preempted: tuple[Hashable, ...] = ()


class SeqOutput(NamedTuple):
    """What one sequence produced in one step (a named tuple: one is built per sequence
    per step, and a tuple is several times cheaper to build than a frozen dataclass)."""

    req_id: Hashable
    new_token_ids: tuple[int, ...]
    first: bool
    """This step produced the sequence's first output token."""
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class Scheduler:
    """vLLM-style scheduler over a :class:`KVCache`, timed by an :class:`EngineProfile`."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        kv_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.profile = profile
        self.kv = KVCache(
            kv_blocks if kv_blocks is not None else profile.kv_blocks,
            profile.block_size,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs {self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} must be at least 1"
            )
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self._seqs: dict[Hashable, SeqState] = {}
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.steps = 0
        self.busy_time = 0.0

    # --- admission ----------------------------------------------------------------------

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``PromptTooLong`` if a request can never run on this engine."""
        limit = self.profile.max_model_len
        if num_prompt_tokens < 1:
            raise PromptTooLong("the prompt is empty; send at least one token")
        if num_prompt_tokens + max_tokens > limit:
            raise PromptTooLong(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for the completion). Shorten the prompt or "
                f"lower max_tokens."
            )
        need = self.kv.blocks_for(num_prompt_tokens + max_tokens)
        if need > self.kv.num_blocks:
            raise PromptTooLong(
                f"the request needs {need} KV blocks but the engine has only "
                f"{self.kv.num_blocks}; shorten the prompt or start the engine with more "
                f"--kv-blocks"
            )

    def add_request(
        self,
        req_id: Hashable,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        arrival: float,
        *,
        salt: str | None = None,
        hashes: Sequence[int] | None = None,
    ) -> SeqState:
        """Queue a request (validated with :meth:`check`).

        ``hashes``: the prompt's full-block hashes if the caller already has them (the
        fleet simulator memoises shared prefixes); they must equal
        ``block_hashes(prompt_tokens, block_size, salt=salt)``.
        """
        if req_id in self._seqs:
            raise ValueError(f"request id {req_id!r} is already in the engine")
        if max_tokens < 1:
            raise ValueError(f"max_tokens {max_tokens} must be at least 1")
        self.check(len(prompt_tokens), max_tokens)
        # A tuple or ``JoinedTokens`` is kept as it is (the fleet simulator's memoised
        # prompts: no copy of hundreds of ids per request); anything else is copied, as
        # the caller may change it.
        kind = type(prompt_tokens)
        tokens = prompt_tokens if kind is tuple or kind is JoinedTokens else list(prompt_tokens)
        seq = SeqState(req_id, tokens, max_tokens, arrival, salt)
        seq.hashes = (
            block_hashes(seq.prompt_tokens, self.kv.block_size, salt=salt)
            if hashes is None
            else list(hashes)
        )
        self._seqs[req_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, req_id: Hashable) -> bool:
        """Drop a request wherever it is and free its blocks; False if unknown/finished."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return False
        if seq.is_running:
            self.running.remove(seq)
            seq.is_running = False
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.kv.free(req_id)
        seq.finish_reason = seq.finish_reason or "abort"
        return True

    def get(self, req_id: Hashable) -> SeqState | None:
        return self._seqs.get(req_id)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step -----------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """Plan the next step and reserve its KV slots; ``None`` when there is nothing to run."""
        budget = self.max_num_batched_tokens
        kv = self.kv
        scheduled: list[tuple[SeqState, int]] = []
        preempted: list[Hashable] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = len(seq.prompt_tokens) + len(seq.output_tokens) - seq.num_computed
            if n > budget:
                n = budget
            if n <= 0:  # cannot happen for a live sequence; keep the loop safe
                i += 1
                continue
            while not kv.grow(seq.req_id, seq.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # the sequence preempted itself; everything after it is gone too

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                hit_blocks = kv.match(seq.hashes, seq.num_tokens)
                start = hit_blocks * kv.block_size
                n = min(seq.num_tokens - start, budget)
                cached = kv.allocate_prompt(
                    seq.req_id, seq.hashes, seq.num_tokens, start + n, hit=hit_blocks
                )
                if cached is None:
                    break
                self.waiting.popleft()
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
                    self.prompt_tokens_total += seq.num_prompt_tokens
                seq.num_computed = cached
                seq.is_running = True
                self.running.append(seq)
                scheduled.append((seq, n))
                budget -= n

        if not scheduled:
            return None
        prefill_tokens = pairs = decode_seqs = decode_ctx = 0
        for seq, n in scheduled:
            if n == 1 and seq.num_computed >= seq.num_prompt_tokens:
                decode_seqs += 1
                decode_ctx += seq.num_computed + 1
            else:  # a prompt chunk, or a preempted sequence recomputing its tokens
                prefill_tokens += n
                pairs += prefill_attn_pairs(seq.num_computed, n)
        work = StepWork(prefill_tokens, pairs, decode_seqs, decode_ctx)
        return Step(tuple(scheduled), work, self.profile.step_time(work), tuple(preempted))

    def complete(self, step: Step, now: float) -> list[SeqOutput]:
        """Apply a planned step that ended at ``now``; returns each sequence's new output."""
        self.steps += 1
        self.busy_time += step.duration
        kv = self.kv
        bs = kv.block_size
        commit = kv.commit
        outs: list[SeqOutput] = []
        finished: list[SeqState] = []
        for seq, n in step.scheduled:
            if not seq.is_running:
                continue  # aborted while the step ran
            if seq.first_scheduled is None:
                seq.first_scheduled = now - step.duration
            before = seq.num_computed
            seq.num_computed = computed = before + n
            # The cache has registered the full blocks before ``before`` (allocation and
            # every earlier commit leave it so): commit only when a block filled up.
            grew = computed // bs > before // bs
            output = seq.output_tokens
            if computed < len(seq.prompt_tokens) + len(output):
                if grew:
                    commit(seq.req_id, seq.hashes, computed)
                continue  # still prefilling (chunked): no token sampled
            # The step covered every known token: sample one output token.
            pos = len(output)
            tok = FILLER_IDS[pos % len(FILLER_IDS)]  # Tokenizer.filler_ids(pos, 1)[0]
            output.append(tok)
            self.generation_tokens_total += 1
            hashes = seq.hashes
            nfull = (len(seq.prompt_tokens) + pos + 1) // bs
            if nfull > len(hashes):
                parent = hashes[-1] if hashes else None
                start = len(hashes) * bs
                prompt = seq.prompt_tokens
                lp = len(prompt)
                # all_tokens()[start : nfull * bs] without copying the whole prompt
                end = nfull * bs
                tail = [*prompt[start:end], *output[max(start - lp, 0) : max(end - lp, 0)]]
                hashes.extend(block_hashes(tail, bs, parent=parent, salt=seq.salt))
            if grew:
                commit(seq.req_id, hashes, computed)
            first = seq.first_token_time is None
            if first:
                seq.first_token_time = now
            done = len(seq.output_tokens) >= seq.max_tokens
            if done:
                seq.finish_time = now
                seq.finish_reason = "length"
                finished.append(seq)
            outs.append(
                SeqOutput(
                    seq.req_id,
                    (tok,),
                    first,
                    done,
                    seq.finish_reason if done else None,
                    seq.num_prompt_tokens,
                    max(seq.num_cached_tokens, 0),
                    len(seq.output_tokens),
                )
            )
        if finished:
            for seq in finished:
                seq.is_running = False
                self.kv.free(seq.req_id)
                del self._seqs[seq.req_id]
            self.running = [s for s in self.running if s.is_running]
        return outs

    def run_until_idle(
        self, now: float = 0.0, *, max_steps: int = 10_000_000
    ) -> tuple[float, list[SeqOutput]]:
        """Run steps back to back on virtual time until no work is left.

        Returns the end time and every output in order. Bounded by ``max_steps``.
        """
        outs: list[SeqOutput] = []
        for _ in range(max_steps):
            step = self.schedule()
            if step is None:
                break
            now += step.duration
            outs.extend(self.complete(step, now))
        return now, outs

    # --- internals ----------------------------------------------------------------------

    def _preempt(self, seq: SeqState) -> None:
        seq.is_running = False
        self.kv.free(seq.req_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
