"""The router's KV-event subscriber: one ZMQ SUB per instance that publishes (adapter).

For each instance configured with ``kv_events: tcp://host:port`` (or ``preheat router
serve --kv-events URL=tcp://...``) a task connects a SUB socket (all topics), receives
vLLM's three-frame messages ``[topic, seq (uint64 big-endian), msgpack [ts, events,
dp_rank?]]`` and applies them to the router's ``PreciseIndex`` (router/kvprecise.py),
which the ``prefix_aware`` policy consults for every synced instance.

It marks an instance ``fallback`` (the learned index decides for it again) when:

* a sequence number is skipped (the index sees it),
* the socket monitor reports the publisher disconnected (the engine stopped),
* an instance owes events (it was sent a prompt whose blocks it lacked) and none came
  for ``kv_events_silence_s`` seconds (5; a stuck or misconfigured publisher).

A malformed message is counted and skipped. Resync: a batch with ``AllBlocksCleared``
(``POST /reset_prefix_cache`` on the engine) or a restarted publisher (sequence 0).

**Late join (replay).** A router started after its engines first sees a sequence number
above 0, so it cannot trust the blocks it was not told about. With ``replay:`` in the
instance's setting (router/kvspec.py; vLLM's ``replay_endpoint``) it asks for the
stream from sequence 0 over a DEALER socket (vLLM's protocol; engine/kvevents.py) and
applies what comes back before the live batches (read after it; duplicates skipped):

* vLLM, while its buffer (``buffer_steps``, 10,000 batches) still holds sequence 0: the
  whole history, so the index is synced;
* vLLM, past that: the buffer's tail, which does not start at 0, so the instance stays
  ``fallback`` (learned index only) until its next ``AllBlocksCleared`` or restart;
* the simulated engine: a snapshot batch (``AllBlocksCleared`` + every block it holds)
  tagged with its last sequence number, so the index is synced at once.

No answer within ``REPLAY_TIMEOUT_S`` (5 s): the instance stays in fallback as without
replay. The instance's tokenizer and hash (router/kvspec.py) are set on the index here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from preheat.engine.kvevents import END_SEQ
from preheat.router.kvprecise import PreciseIndex
from preheat.router.kvspec import KVEventsSpec, PromptCache, parse_kv_events, prompt_blocks

__all__ = ["KVEventSubscriber"]

log = logging.getLogger("preheat.router.kvevents")
REPLAY_TIMEOUT_S = 5.0


class KVEventSubscriber:
    """Keeps one subscriber task per (instance, endpoint) and the silence watchdog."""

    def __init__(self, index: PreciseIndex, silence_s: float = 5.0) -> None:
        self.index = index
        self.silence_s = silence_s
        self.endpoints: dict[str, str] = {}
        self.specs: dict[str, KVEventsSpec] = {}
        self.malformed = 0
        self.replays = 0
        self._prompts: PromptCache = {}
        self._dedupe: dict[str, int] = {}  # after a replay: live batches up to this are old
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._owed_since: dict[str, float] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._watch: asyncio.Task[None] | None = None

    def configure(self, endpoints: Mapping[str, str], silence_s: float) -> None:
        """Follow a new config (``{instance URL: kv_events setting}``): subscribe to new
        endpoints, drop the ones that left, set each instance's tokenizer and hash."""
        specs = {u: parse_kv_events(v, where=f"instance {u}") for u, v in endpoints.items()}
        prompts = {u: prompt_blocks(sp, self._prompts) for u, sp in specs.items()}
        self.silence_s = silence_s
        self.endpoints = dict(endpoints)
        self.specs = specs
        for url in list(self.index.instances):
            if url not in self.endpoints:
                self.index.remove(url)
        for url in self.endpoints:
            self.index.add(url, prompts[url])
        if self._ctx is not None:
            self._reconcile()

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._reconcile()
        self._watch = asyncio.create_task(self._watchdog(), name="router-kv-events-watch")

    async def stop(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        if self._watch is not None:
            tasks.append(self._watch)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _reconcile(self) -> None:
        for url, (ep, task) in list(self._tasks.items()):
            if self.endpoints.get(url) != ep:
                task.cancel()
                del self._tasks[url]
        for url, ep in self.endpoints.items():
            if url not in self._tasks:
                task = asyncio.create_task(self._run(url, ep), name=f"router-kv-events {url}")
                self._tasks[url] = (ep, task)

    async def _run(self, url: str, endpoint: str) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        spec = self.specs.get(url)
        sock.connect(spec.endpoint if spec is not None else endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            while True:
                for s, _ in await poller.poll():
                    if s is mon:
                        ev = parse_monitor_message(await mon.recv_multipart())
                        if ev["event"] == zmq.EVENT_DISCONNECTED:
                            log.warning("KV events of %s: publisher disconnected", url)
                            self.index.lost(url, "publisher disconnected")
                    else:
                        frames = await sock.recv_multipart()
                        if self._joining(url, frames) and spec is not None and spec.replay:
                            await self._replay(url, spec.replay)
                        self._handle(url, frames)
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(0)

    def _joining(self, url: str, frames: list[bytes]) -> bool:
        """The first batch this router sees from the instance comes mid-stream."""
        ib = self.index.instances.get(url)
        return (
            ib is not None
            and ib.last_seq < 0
            and len(frames) == 3
            and len(frames[1]) == 8
            and int.from_bytes(frames[1], "big") > 0
        )

    async def _replay(self, url: str, endpoint: str) -> None:
        """Ask the publisher's replay socket for the stream from 0 and apply the answer."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        got = 0
        try:
            await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await sock.recv_multipart()
                    frames = frames[1:] if frames and frames[0] == b"" else frames
                    if len(frames) == 3:  # a topic frame (newer vLLM): drop it
                        frames = frames[1:]
                    if len(frames) != 2 or frames[0] == END_SEQ:
                        break
                    self._handle(url, [b"", frames[0], frames[1]])
                    got += 1
        except TimeoutError:
            log.warning(
                "KV events of %s: no replay answer from %s in %.0fs",
                url,
                endpoint,
                REPLAY_TIMEOUT_S,
            )
        finally:
            sock.close(0)
        self.replays += 1
        ib = self.index.instances.get(url)
        if ib is not None and ib.last_seq >= 0:
            self._dedupe[url] = ib.last_seq
        log.info("KV events of %s: replayed %d batch(es) -> %s", url, got, self.index.state(url))

    def _handle(self, url: str, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"{len(frames)} frames")
            seq = int.from_bytes(frames[1], "big")
            upto = self._dedupe.get(url)
            if upto is not None:
                if 0 < seq <= upto:
                    return  # already applied from the replay
                del self._dedupe[url]
            batch = msgpack.unpackb(frames[2])
            if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
                raise ValueError("the payload is not an EventBatch [ts, events, ...]")
        except (ValueError, msgpack.UnpackException) as exc:
            self.malformed += 1
            log.warning("KV events of %s: malformed message skipped (%s)", url, exc)
            return
        before = self.index.state(url)
        self.index.apply(url, seq, batch[1])
        self._owed_since.pop(url, None)
        after = self.index.state(url)
        if after != before:
            log.info("KV events of %s: %s -> %s", url, before, after)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(self.silence_s / 4, 0.5))
            now = time.monotonic()
            for url, ib in self.index.instances.items():
                if not ib.owes_events:
                    self._owed_since.pop(url, None)
                    continue
                t0 = self._owed_since.setdefault(url, now)
                if now - t0 >= self.silence_s:
                    log.warning("KV events of %s: silent for %.1fs", url, now - t0)
                    self.index.lost(url, f"no KV event for {self.silence_s:g}s after a request")
                    self._owed_since.pop(url, None)
