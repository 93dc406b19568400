"""Warm-ups: fill a revision into a node's store ahead of the replicas that need it.

A warm-up is one background task per (node, revision); a second ``Warm`` for the same
pair while one runs is a no-op. The node's ``CacheView`` tells the planner where it
stands (``WarmState``): ``warming`` while the fill runs (``progress`` has bytes done and
total), ``ready`` once the snapshot is published (pinned if the spec says so),
``failed`` with the reason and a backoff (``WARM_BACKOFF``) before the planner warms it
again, ``unfit`` with the numbers when the node's disk cannot hold the model: for good
when the model is bigger than what the store can ever hold (its capacity, or its disk's
total size when that is smaller, x the store's high watermark), else (other fills'
reservations, leased or pinned copies take the room now) looked at again after the same
backoff.

A replica on a cold node pulls the revision itself (``pull_for_replica``): it shares a
warm-up already running there and otherwise retries a failed pull (an unreachable
origin with no peer holding the revision) with the same backoff, the reason in the
replica's ``detail``, until it is stopped.

Pulls are a fan-out (``runtime.peering``, ``control.fanout``; on unless the cluster
file says ``peers: {enabled: false}``): a warm-up, and a replica's own pull on a cold
node alike, first waits for its turn (an origin slot of the cluster-wide budget, or
peers that hold or are seeding every blob it lacks; the view and the replica's detail
say so), then fills piece by piece from peers first, the origin last. A cold replica
therefore reads from the origin only when no other up node holds or seeds the
revision (the fleet's first copy), and completes from peers while the origin is down.
With peers off every pull fills from the origin, and the budget still holds
(``runtime.peering.OriginGate``): a warm-up waits for an origin slot, a replica's own
pull takes one at once (and does not wait behind a warm-up still waiting for its slot),
so warm-ups yield the origin to starts.

A warm-up's fill never evicts another warm-up's copy that no replica has used yet
(``runtime.warm_room``); it waits instead (``failed`` with the reason, retried with the
backoff; not ``unfit``, so a replica may still be placed there). A replica's own pull
evicts as before.
Each finished warm-up is a ``WarmupRecord`` (seconds, ``bytes_from`` per source) in
``FleetState.warmups``; origin bytes per (node, revision) stay in
``FleetState.origin_bytes``.

The endpoint's container images (``modelCacheConfig.image.enabled``) are pre-pulled
beside the weights by ``runtime.image_warmup.ImageWarmer`` (``Warmer.images``); they
never gate anything.

Failure reasons are redacted (``redact_url``) before they reach a cache view, the
node's ``WarmupFailure`` (a Prometheus label), a message or a replica's detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Callable

from preheat.artifacts.refs import redact_url
from preheat.config import format_size
from preheat.errors import FetchError, InsufficientSpace, PreheatError, WarmupDeferred
from preheat.runtime.image_warmup import ImageWarmer
from preheat.runtime.model import FleetState, Node, Replica, WarmState, cache_view
from preheat.runtime.nodestore import PullOutcome
from preheat.runtime.peering import FleetPeers, OriginGate
from preheat.runtime.warm_room import WarmCopies
from preheat.store.fill import RateLimiter
from preheat.store.layout import Layout
from preheat.telemetry.inventory import WarmupFailure
from preheat.telemetry.records import WarmupRecord

__all__ = ["WARM_BACKOFF", "Warmer"]

WARM_BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0)


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt + 1`` (0-based attempt)."""
    return WARM_BACKOFF[min(attempt, len(WARM_BACKOFF) - 1)]


async def _store_bound(node: Node) -> int:
    """The most the node's store can ever hold: its capacity, or its disk's total size
    when that is smaller (the store is then bounded by its disk; ``disk_usage`` off the
    loop, a network filesystem may block); the capacity alone when the disk cannot be
    read."""
    try:
        disk = (await asyncio.to_thread(shutil.disk_usage, node.cache.store.root)).total
    except OSError:
        return node.spec.capacity
    return min(node.spec.capacity, disk)


class Warmer:
    """Starts and tracks warm-ups on the fleet's nodes."""

    def __init__(self, state: FleetState) -> None:
        self.state = state
        #: Image pre-pulls and references (``modelCacheConfig.image``).
        self.images = ImageWarmer(state)
        cluster = state.cluster
        #: The fan-out (None with ``peers.enabled: false``: every node fills from the origin).
        self.peers = (
            FleetPeers(cluster.origin.budget, self._peer_nodes, state.say)
            if cluster.peers.enabled
            else None
        )
        #: The origin budget: the fan-out's, or ``OriginGate`` alone with peers off.
        self.gate: OriginGate = (
            self.peers if self.peers is not None else OriginGate(cluster.origin.budget)
        )
        self.origin_limiter: RateLimiter | None = self.gate.origin_limiter
        #: Warm-ups' copies no replica has used yet (spared by other warm-ups' fills).
        self.copies = WarmCopies()
        #: (node, revision) of warm-ups waiting for an origin slot (peers off).
        self._held: set[tuple[str, str]] = set()

    def _peer_nodes(self) -> dict[str, tuple[Layout, bool]]:
        return {
            name: (n.cache.store.layout, n.up)
            for name, n in self.state.nodes.items()
            if not n.cache.closed
        }

    def start(self, node_name: str, revision: str) -> None:
        """Warm ``revision`` on the node in the background (idempotent while it runs)."""
        node = self.state.nodes[node_name]
        running = node.warm_tasks.get(revision)
        if running is not None and not running.done():
            return
        node.views[revision] = cache_view(WarmState.WARMING)
        task = asyncio.create_task(self._warm(node, revision), name=f"warm-{node_name}")
        node.warm_tasks[revision] = self.state.log.watch(task, f"warm-up on {node_name}")

    def cancel_node(self, node: Node) -> None:
        """A lost node's running warm-ups stop; it is warmed again when it comes back."""
        for rev, task in list(node.warm_tasks.items()):
            if not task.done():
                task.cancel()
                node.views.pop(rev, None)
        self.images.cancel_node(node)

    async def stop(self) -> None:
        """Cancel every warm-up and wait for them (partial files stay resumable)."""
        tasks = [t for n in self.state.nodes.values() for t in n.warm_tasks.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.peers is not None:
            await self.peers.aclose()
        await self.images.stop()

    async def pull(
        self,
        node: Node,
        revision: str,
        *,
        fan_out: bool = False,
        on_wait: Callable[[str], None] | None = None,
    ) -> PullOutcome:
        """Pull ``revision`` into ``node``; updates the node's cache view either way.
        With peers on it waits for its turn in the fan-out (``on_wait`` hears why) and
        uses peers; ``fan_out`` (a warm-up) also records a ``WarmupRecord``."""
        st = self.state
        rv = st.rv(revision)
        node.views[revision] = cache_view(WarmState.WARMING)
        started = st.clock.now()

        def progress(done: int, total: int) -> None:
            node.progress[revision] = (done, total)

        def waiting(why: str) -> None:
            node.views[revision] = cache_view(WarmState.WARMING, reason=why)
            if on_wait is not None:
                on_wait(why)

        admission = None
        gated = False
        key = (node.name, revision)
        try:
            if self.peers is not None:
                admission = await self.peers.admit(node.name, revision, rv.source, waiting)
                node.views[revision] = cache_view(WarmState.WARMING)
            else:
                if fan_out:
                    self._held.add(key)
                try:
                    await self.gate.admit_origin(node.name, revision, waiting, wait=fan_out)
                finally:
                    self._held.discard(key)
                gated = True
                node.views[revision] = cache_view(WarmState.WARMING)
            # a warm-up's reservation spares the unused warmed copies, under the store's
            # lock (``warm_room``); a replica's pull evicts as before
            spare = frozenset[str]()
            if fan_out:
                spare = await asyncio.to_thread(self.copies.unused, node.cache.store)
            outcome = await node.cache.pull(
                rv.source,
                revision,
                progress=progress,
                peers=admission.fill if admission is not None else None,
                origin_limiter=self.origin_limiter,
                pinned=admission.pinned if admission is not None else None,
                spare=spare,
            )
            if fan_out and outcome.bytes_fetched:
                # recorded before the origin slot frees (``finally``): the warm-up admitted
                # next reads its spare from this record, so it never evicts this copy
                await asyncio.to_thread(
                    self.copies.record, node.name, node.cache.store, outcome.manifest_digest
                )
        except WarmupDeferred as exc:
            # Not unfit (a replica may still start here and evict): retried with backoff.
            why = redact_url(str(exc))
            n = node.warm_failures[revision]
            node.warm_failures[revision] += 1
            delay = backoff(n)
            node.views[revision] = cache_view(
                WarmState.FAILED, reason=why, retry_at=st.clock.now() + delay, short_of_room=True
            )
            if n == 0:
                st.say(f"warm-up of {revision[:12]} on {node.name} waits: {why}")
            raise
        except InsufficientSpace as exc:
            why = redact_url(str(exc))
            n = node.warm_failures[revision]
            retry_at = 0.0  # the model is bigger than the node's store: for good
            bound = await _store_bound(node)
            short = rv.model_bytes <= bound * node.cache.store.high_watermark
            if short:
                # It fits once other fills finish or copies are released: look again.
                node.warm_failures[revision] += 1
                retry_at = st.clock.now() + backoff(n)
            node.views[revision] = cache_view(
                WarmState.UNFIT, reason=why, retry_at=retry_at, short_of_room=short
            )
            node.last_failure = WarmupFailure(revision, why, st.clock.wall())
            if n == 0:
                st.say(f"{node.name} cannot hold {revision[:12]}: {why}")
            raise
        except (FetchError, PreheatError, OSError) as exc:
            why = redact_url(str(exc))
            n = node.warm_failures[revision]
            node.warm_failures[revision] += 1
            delay = backoff(n)
            node.views[revision] = cache_view(
                WarmState.FAILED,
                reason=f"{why}; retry {n + 1} in {delay:.0f} s",
                retry_at=st.clock.now() + delay,
            )
            node.last_failure = WarmupFailure(revision, why, st.clock.wall())
            st.say(f"warm-up of {revision[:12]} on {node.name} failed: {why}")
            raise
        finally:
            node.progress.pop(revision, None)
            if admission is not None or gated:
                self.gate.release(node.name, revision)
        node.warm_failures.pop(revision, None)
        if admission is not None and (admission.fill.peer_failures or admission.fill.seed_stalls):
            fill = admission.fill
            st.say(
                f"pull of {revision[:12]} on {node.name}: {fill.peer_failures} peer "
                f"failure(s), {fill.seed_stalls} piece(s) after a stalled seed, taken from "
                "another peer or the origin"
            )
        # The node's last warm-up now succeeded: its failure is history (said above).
        node.last_failure = None
        bytes_from = outcome.bytes_from
        st.origin_bytes[(node.name, revision)] += bytes_from["origin"]
        if fan_out:
            if admission is not None:
                mode = admission.mode.value
            else:
                mode = "origin" if bytes_from["origin"] else "cache"
            if outcome.bytes_fetched == 0:
                mode = "cache"
            st.warmups[(node.name, revision)] = WarmupRecord(
                node.name,
                revision,
                max(0.0, st.clock.now() - started),
                mode,
                {k: v for k, v in bytes_from.items() if v},
            )
        node.views[revision] = cache_view(WarmState.READY)
        weights = st.spec.cache.weights
        if weights.pin:
            await asyncio.to_thread(node.cache.pin, revision, weights.priority)
        st.wake()
        return outcome

    async def _warm(self, node: Node, revision: str) -> None:
        try:
            outcome = await self.pull(node, revision, fan_out=True)
        except (PreheatError, OSError):
            return  # the view says why and when it is retried
        except Exception as exc:
            # Unexpected (logged with its traceback by ``FleetLog.watch``): leave a view
            # the planner retries, not a "warming" that never ends.
            node.views[revision] = cache_view(
                WarmState.FAILED,
                reason=f"unexpected {type(exc).__name__}; see the fleet log",
                retry_at=self.state.clock.now() + backoff(node.warm_failures[revision]),
            )
            raise
        self.state.say(
            f"warmed {revision[:12]} on {node.name}: "
            f"{format_size(outcome.bytes_from['origin'])} from origin, "
            f"{format_size(outcome.bytes_from_peers)} from peers, "
            f"{format_size(outcome.bytes_reused)} reused, {outcome.seconds:.1f} s"
        )

    async def pull_for_replica(self, r: Replica, node: Node) -> PullOutcome:
        """A replica on a cold node fetches the revision itself (peers first, then the
        origin), waiting out a failed pull (status shows why) until the replica is stopped."""
        # Share a warm-up that is already running on this node.
        task = node.warm_tasks.get(r.revision)
        held = (node.name, r.revision) in self._held  # waits for an origin slot: go first
        if task is not None and not task.done() and not held:
            r.detail = "waiting for this node's warm-up"
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        attempt = 0
        while True:

            def waiting(why: str) -> None:
                r.detail = why

            try:
                return await self.pull(node, r.revision, on_wait=waiting)
            except InsufficientSpace:
                raise
            except (FetchError, PreheatError, OSError) as exc:
                delay = backoff(attempt)
                attempt += 1
                r.detail = (
                    f"origin fetch failed ({redact_url(str(exc))}); retrying in {delay:.0f} s"
                )
                await asyncio.sleep(delay)
