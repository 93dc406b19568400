"""The simulated engine's engine task: one task owns the scheduler and feeds the requests.

Resource handling: the task plans a step, sleeps ``step.duration x time_scale`` against a
running deadline (so timer slack does not accumulate), applies the step and hands each
request its new tokens through its sink. ``time_scale 0`` never sleeps: steps run back to
back, yielding to the event loop in between. With KV events on, each step's prefix-cache
changes are published as one vLLM EventBatch, and replay requests are answered.

Error handling: a client that disconnects mid-request has its sequence aborted and its KV
blocks freed. An unexpected exception inside a scheduling step is logged with its
traceback; the step's requests (every request in the engine when planning itself failed)
are aborted and answered 500 (or end their stream with an ``error`` event), and the loop
goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from preheat.errors import PromptTooLong
from preheat.kvhash import make_scheme

from .config import EngineConfig
from .core.scheduler import Scheduler, SeqOutput
from .core.tokenizer import Tokenizer
from .kvevents import ExternalHashes, KVEventPublisher, batch_events, parse_options
from .metrics import EngineMetrics
from .openai_api import BadRequest

__all__ = ["EngineTask"]

log = logging.getLogger("preheat.engine")


@dataclass(eq=False)
class _Sink:
    """Where the engine task delivers one request's tokens."""

    stream: bool
    queue: asyncio.Queue[SeqOutput | None] | None = None
    done: asyncio.Future[SeqOutput] | None = None
    last: SeqOutput | None = None
    arrival: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class EngineTask:
    """The scheduler, the requests' sinks and the task that runs steps (``EngineServer``'s base)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.profile = config.profile
        self.model = config.served_model
        self.sched = Scheduler(
            config.profile,
            kv_blocks=config.kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.tokenizer = Tokenizer()
        self.metrics = EngineMetrics(self.sched, self.model)
        self.time_scale = config.time_scale
        self._sinks: dict[Hashable, _Sink] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._engine_task: asyncio.Task[None] | None = None
        self._kv_pub: KVEventPublisher | None = None
        self._kv_tokens: dict[Hashable, tuple[list[int], int, str | None]] = {}
        self._kv_ext: ExternalHashes | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if config.kv_events:
            opts = parse_options(config.kv_events)
            pod = config.kv_events_pod or f"{config.host}:{config.port}"
            self._kv_pub = KVEventPublisher(
                opts.endpoint,
                f"kv@{pod}@{self.model}",
                replay=opts.replay,
                block_size=self.sched.kv.block_size,
                buffer_steps=opts.buffer_steps,
            )
            self._kv_ext = ExternalHashes(make_scheme(opts.hash, opts.hash_seed))
            self.sched.kv.events = []

    async def _serve_replay(self) -> None:
        """Answer KV-event replay requests every 50 ms; changes not yet published are
        published first, so a snapshot is the cache as of its sequence number."""
        pub = self._kv_pub
        assert pub is not None
        while True:
            await asyncio.sleep(0.05)
            if pub.replay_waiting():
                self._publish_kv()
                pub.serve_replay()

    # --- engine task --------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        sched = self.sched
        deadline = time.monotonic()
        while True:
            if not sched.has_work:
                self._wake.clear()
                await self._wake.wait()
                deadline = time.monotonic()
            step = None
            try:
                step = sched.schedule()
                if step is None:  # waiting but nothing admissible and nothing running
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                dt = step.duration * self.time_scale
                if dt > 0:
                    now = time.monotonic()
                    # Catch up at most one step of timer lateness; never run ahead.
                    deadline = max(deadline, now - dt) + dt
                    if deadline > now:
                        await asyncio.sleep(deadline - now)
                else:
                    await asyncio.sleep(0)
                now = time.monotonic()
                for out in sched.complete(step, now):
                    self._deliver(out, now)
                if self._kv_pub is not None:
                    self._publish_kv()
            except Exception:
                ids = (
                    [seq.req_id for seq, _ in step.scheduled]
                    if step is not None
                    else list(self._sinks)
                )
                log.exception(
                    "engine step failed; failing its %d request(s) and going on", len(ids)
                )
                for req_id in ids:
                    self._fail(req_id, "the engine step failed unexpectedly; retry the request")
                await asyncio.sleep(0)

    def _publish_kv(self) -> None:
        """Send the prefix cache's changes since the last call as one vLLM EventBatch."""
        kv = self.sched.kv
        raw = kv.events
        if self._kv_pub is None or not raw:
            return
        kv.events = []

        def tokens_of(seq: Hashable) -> list[int] | None:
            known = self._kv_tokens.get(seq)
            if known is None:
                return None
            prompt, max_tokens, _ = known
            return prompt + Tokenizer.filler_ids(0, max_tokens)

        def salt_of(seq: Hashable) -> str | None:
            known = self._kv_tokens.get(seq)
            return known[2] if known is not None else None

        self._kv_pub.publish(batch_events(raw, tokens_of, kv.block_size, self._kv_ext, salt_of))
        for req_id in [r for r in self._kv_tokens if r not in self._sinks]:
            del self._kv_tokens[req_id]

    def _fail(self, req_id: Hashable, message: str) -> None:
        """Abort a request and answer it with a server error (500 or an SSE error event)."""
        sink = self._sinks.pop(req_id, None)
        with contextlib.suppress(Exception):
            self.sched.abort(req_id)
        if sink is None:
            return
        self.metrics.finished("abort")
        if sink.stream:
            assert sink.queue is not None
            sink.queue.put_nowait(None)
        elif sink.done is not None and not sink.done.done():
            sink.done.set_exception(BadRequest(500, message))

    def _deliver(self, out: SeqOutput, now: float) -> None:
        sink = self._sinks.get(out.req_id)
        if sink is None:
            return
        if out.first:
            self.metrics.ttft.observe(now - sink.arrival)
        if out.finished:
            self.metrics.e2e.observe(now - sink.arrival)
            self.metrics.finished(out.finish_reason or "length")
            del self._sinks[out.req_id]
        if sink.stream:
            assert sink.queue is not None
            sink.queue.put_nowait(out)
        elif out.finished:
            assert sink.done is not None
            if not sink.done.done():
                sink.done.set_result(out)

    def _submit(
        self, tokens: list[int], max_tokens: int, stream: bool, salt: str | None, param: str
    ) -> tuple[str, _Sink]:
        req_id = f"{next(self._ids):x}"
        loop = asyncio.get_running_loop()
        sink = _Sink(stream=stream, arrival=time.monotonic())
        if stream:
            sink.queue = asyncio.Queue()
        else:
            sink.done = loop.create_future()
        try:
            self.sched.add_request(req_id, tokens, max_tokens, sink.arrival, salt=salt)
        except PromptTooLong as exc:
            raise BadRequest(400, str(exc), param) from exc
        self._sinks[req_id] = sink
        if self._kv_pub is not None:
            self._kv_tokens[req_id] = (tokens, max_tokens, salt)
        self._wake.set()
        return req_id, sink

    def _abort(self, req_id: str) -> None:
        if self._sinks.pop(req_id, None) is not None:
            self.sched.abort(req_id)
            self.metrics.finished("abort")
