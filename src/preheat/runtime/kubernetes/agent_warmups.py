"""The node agent's warm-ups: one asyncio task per wanted revision (at most
``max_warmups`` filling at once), retried with capped exponential back-off while the
origin fails; and the pins and priorities the targeting caches ask of the store.

A warm-up's fill never evicts another warm-up's copy that no pod has used yet
(``runtime.warm_room.WarmCopies``, recorded in the node store so an agent restart keeps
them): once admitted (after its origin admission, with peers) it passes those copies as
``spare`` to the store's pull, whose reservation evicts by plan around them under the
store's lock, or fails with ``WarmupDeferred`` (the numbers in ``lastFailure``) and is
retried with the back-off, until a pod's lease of a copy frees that copy for eviction, or
room appears. Only copies some targeting cache still wants are spared: a copy no cache
wants any more (its ``ModelDataCache`` deleted after a rollout, or no longer targeting
the node) is unpinned with priority 0 and is the first eviction takes, not a warm-up's
work to protect (sparing it kept its room from every later warm-up for good). In
Kubernetes mode every pull into the node store is a warm-up (a cold pod pulls into its
own ``emptyDir``, ``snapshot_init``), so only the store's other rules (pins, leases,
priority) decide beyond that."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from preheat.artifacts.refs import redact_url
from preheat.errors import InsufficientSpace, PreheatError
from preheat.runtime.kubernetes.agent_config import AgentConfig
from preheat.runtime.kubernetes.agent_metrics import AgentMetrics
from preheat.runtime.warm_room import WarmCopies
from preheat.store import NodeStore
from preheat.store.results import PullResult
from preheat.telemetry.inventory import WarmupFailure

__all__ = ["Warm", "Warmups"]

log = logging.getLogger("preheat.agent")


@dataclass
class Warm:
    """One revision being warmed (or retried)."""

    source: str
    revision: str | None
    state: str = "Filling"
    done: int = 0
    #: ``NoRoom`` while the last failure was the store's ``InsufficientSpace``.
    reason: str = ""
    task: asyncio.Task[None] | None = None


class Warmups:
    """The warm-ups in flight (``warms``), the revisions sources resolved to and the last
    failure; owned by the ``NodeAgent``, which says what is wanted."""

    def __init__(
        self, cfg: AgentConfig, store: NodeStore, metrics: AgentMetrics, dirty: asyncio.Event
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.warms: dict[str, Warm] = {}
        self.last_failure: WarmupFailure | None = None
        #: source -> revision it resolved to, for caches that name no revision.
        self.resolved: dict[str, str] = {}
        self._dirty = dirty
        self._sem = asyncio.Semaphore(cfg.max_warmups)
        #: ``(source, revision, progress) -> PullResult`` replacing the store's own pull
        #: (the agent's peers, ``agent_peers.AgentPeers.pull``, which calls ``room``
        #: once admitted); None: ``room`` then ``store.apull``.
        self.puller: Callable[..., Awaitable[PullResult]] | None = None
        #: This agent's warm-ups' copies no pod has used yet (spared by later warm-ups).
        self.copies = WarmCopies()
        #: Revisions (or, unresolved, sources) the targeting caches want
        #: (``apply_policies``); None until the first call: every unused copy is spared.
        self.targeted: frozenset[str] | None = None

    async def room(self, source: str, revision: str | None) -> frozenset[str]:
        """The ``spare`` of a warm-up's fill: the store's warmed copies no pod has used
        yet (module docstring; the store raises ``WarmupDeferred`` when only those could
        make the room); only the copies a targeting cache still wants."""
        return await asyncio.to_thread(self._spare)

    def _spare(self) -> frozenset[str]:
        unused = self.copies.unused(self.store)
        targeted = self.targeted
        if not unused or targeted is None:
            return unused
        return frozenset(
            s.digest
            for s in self.store.snapshots()
            if s.digest in unused and not targeted.isdisjoint((s.digest, *s.revisions, *s.refs))
        )

    def apply_policies(self, targeting: list[dict[str, Any]]) -> None:
        """Pin a held snapshot while a targeting cache says ``pin``, give it the highest
        ``priority`` any of them asks for; a snapshot no cache wants is unpinned, priority 0
        (the agent owns the store in Kubernetes mode)."""
        pin: dict[str, bool] = {}
        prio: dict[str, int] = {}
        sources: set[str] = set()
        for spec in targeting:
            rev = spec.get("revision") or self.resolved.get(spec["source"])
            if rev is None:  # not resolved yet (a restart): spare its copy by its ref
                sources.add(spec["source"])
                continue
            pin[rev] = pin.get(rev, False) or bool(spec.get("pin"))
            prio[rev] = max(prio.get(rev, 0), int(spec.get("priority") or 0))
        self.targeted = frozenset(pin) | sources
        for info in self.store.snapshots():
            keys = [*info.revisions, info.digest]
            want_pin = any(pin.get(k, False) for k in keys)
            want_prio = max((prio.get(k, 0) for k in keys), default=0)
            if info.pinned != want_pin:
                (self.store.pin if want_pin else self.store.unpin)(info.digest)
            if info.priority != want_prio:
                self.store.set_priority(info.digest, want_prio)

    def held(self, key: str) -> bool:
        """Whether the store holds the snapshot ``key`` (revision or digest)."""
        try:
            return self.store.has(key)
        except PreheatError:
            return False

    def ensure(self, wanted: dict[str, tuple[str, str | None]]) -> None:
        """One task per wanted ``key -> (source, revision)`` not held yet; cancel the rest."""
        for key, (source, rev) in wanted.items():
            w = self.warms.get(key)
            if w is not None and (w.source, w.revision) == (source, rev):
                continue
            if w is not None and w.task is not None:
                w.task.cancel()
            resolved = rev or self.resolved.get(source)
            if resolved is not None and self.held(resolved):
                self.warms.pop(key, None)
                continue
            w = Warm(source, rev)
            w.task = asyncio.create_task(self._warm(key, w), name=f"warm {key}")
            self.warms[key] = w
        for key in set(self.warms) - set(wanted):
            task = self.warms.pop(key).task
            if task is not None:
                task.cancel()

    def cancel_all(self) -> None:
        for w in self.warms.values():
            if w.task is not None:
                w.task.cancel()

    async def _warm(self, key: str, w: Warm) -> None:
        delay = self.cfg.backoff_s
        while True:
            try:
                async with self._sem:
                    w.state, w.done, w.reason = "Filling", 0, ""
                    self._dirty.set()

                    def progress(done: int, total: int) -> None:
                        w.done = done

                    if self.puller is not None:
                        res = await self.puller(w.source, w.revision, progress)
                    else:
                        spare = await self.room(w.source, w.revision)
                        res = await self.store.apull(
                            w.source, revision=w.revision, progress=progress, spare=spare
                        )
                    if res.bytes_fetched:
                        await asyncio.to_thread(
                            self.copies.record, self.cfg.node, self.store, res.manifest_digest
                        )
                self.metrics.fetched.inc(res.bytes_fetched)
                self.resolved[w.source] = res.revision
                self.metrics.warmups.labels("ok").inc()
                log.info(
                    "warmed %s: %d bytes fetched, %d reused",
                    res.revision,
                    res.bytes_fetched,
                    res.bytes_reused,
                )
                if self.warms.get(key) is w:
                    del self.warms[key]
                self._dirty.set()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is retried; the reason is reported
                self.metrics.warmups.labels("failed").inc()
                w.state = "Failed"
                w.reason = "NoRoom" if isinstance(exc, InsufficientSpace) else ""
                reason = f"{type(exc).__name__}: {exc}"
                self.last_failure = WarmupFailure(w.revision or w.source, reason, time.time())
                log.warning("warm-up of %s failed, retry in %.1f s: %s",
                            redact_url(key), delay, self.last_failure.reason)  # fmt: skip
                self._dirty.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.backoff_max_s)
