"""One simulated engine on virtual time: the live ``engine.core`` scheduler, step by step (pure).

The same loop as ``engine/task.py``'s engine task, with the sleep replaced by an event:
when work arrives at an idle engine it plans a step (``Scheduler.schedule``) at once; the
step's end is an event ``step.duration`` later, where ``Scheduler.complete`` applies it
and the next step is planned. Requests that arrive during a step join the next one.
Continuous batching, chunked prefill, the prefix KV cache and preemption are the
scheduler's own; one event per batch step, none per token.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from preheat.engine.core.scheduler import Scheduler, SeqOutput, Step
from preheat.timing import EngineProfile

__all__ = ["SimEngine"]


class SimEngine:
    """A scheduler and the step it is running; the fleet owns the event queue."""

    __slots__ = ("busy_until", "index", "sched", "step")

    def __init__(
        self,
        index: int,
        profile: EngineProfile,
        *,
        kv_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.index = index
        self.sched = Scheduler(
            profile,
            kv_blocks=kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.step: Step | None = None
        self.busy_until = 0.0

    def submit(
        self,
        req_id: Hashable,
        tokens: Sequence[int],
        hashes: Sequence[int],
        max_tokens: int,
        now: float,
        *,
        salt: str | None = None,
    ) -> float | None:
        """Queue a request (``PromptTooLong`` if it can never run); returns the end time
        of a step that must be scheduled now, or ``None`` if one is already running."""
        self.sched.add_request(req_id, tokens, max_tokens, now, salt=salt, hashes=hashes)
        if self.step is None:
            return self.plan(now)
        return None

    def plan(self, now: float) -> float | None:
        """Plan the next step at ``now``; its end time, or ``None`` when idle."""
        step = self.sched.schedule()
        self.step = step
        if step is None:
            return None
        self.busy_until = end = now + step.duration
        return end

    def finish_step(self, now: float) -> list[SeqOutput]:
        """Apply the running step, which ended at ``now``; the sequences' new outputs."""
        step = self.step
        if step is None:
            raise RuntimeError(f"engine {self.index} has no step running at t={now}")
        self.step = None
        return self.sched.complete(step, now)
