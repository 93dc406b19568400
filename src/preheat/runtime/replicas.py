"""Replica supervision: start, health, first response, restarts, leases, start records.

A replica (``model.Replica``) goes through ``ReplicaPhase``:

1. **starting**: with ``modelCacheConfig.image.enabled``, the replica's image on the
   node (``ImageWarmer.for_replica``: the node's copy, else a pull into the node store;
   a failed pull never fails the start), then a lease on the node's snapshot (a cold node first pulls the revision
   itself, recorded as an origin fetch), a free port, the engine process (``preheat
   engine serve --snapshot DIR`` or the spec's command), ``/health`` within
   ``startup_timeout``, the engine's own ``/startup`` stages, then one request straight
   to it;
2. **ready**: the planner's ``AddRoute`` puts it into the router;
3. **draining**: out of the router, until the router reports nothing in flight to it
   (or ``DRAIN_TIMEOUT``), then stopped; **stopped**: process gone, lease released.

Every start attempt is written as a ``StartRecord`` (its class from
``telemetry.classify``; made by ``runtime.replica_record``). The engine's command line,
its ``/startup`` stages and the first request are ``runtime.replica_engine``. A process that exits on its own is taken out of the router and
restarted on its node; after ``MAX_RESTARTS`` within ``RESTART_WINDOW`` seconds it is
``failed`` (the planner replaces it or rolls back). Failed starts back off per variant
(``next_start_at``), like Kubernetes' CrashLoopBackOff.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

import aiohttp

from preheat.artifacts.refs import redact_url
from preheat.control.state import StartReplica
from preheat.errors import ControlError, InsufficientSpace, PreheatError
from preheat.runtime.model import FleetState, Node, Replica, ReplicaPhase
from preheat.runtime.procs import free_port, spawn, wait_http_ok
from preheat.runtime.replica_engine import engine_argv, engine_stages, first_response
from preheat.runtime.replica_record import start_record
from preheat.runtime.router_proc import RouterProcess
from preheat.runtime.warmup import Warmer
from preheat.telemetry.classify import StartContext, StartReason, classify_start
from preheat.telemetry.events import EventLog

__all__ = ["DRAIN_TIMEOUT", "MAX_RESTARTS", "RESTART_WINDOW", "Supervisor"]

MAX_RESTARTS = 3
RESTART_WINDOW = 120.0
DRAIN_TIMEOUT = 30.0


class Supervisor:
    """Starts, supervises, drains and stops the fleet's replicas."""

    def __init__(
        self,
        state: FleetState,
        router: RouterProcess,
        warmer: Warmer,
        events: EventLog,
        *,
        startup_timeout: float,
    ) -> None:
        self.state = state
        self.router = router
        self.warmer = warmer
        self.events = events
        self.startup_timeout = startup_timeout
        self.session: aiohttp.ClientSession | None = None
        #: variant -> failed starts in a row; the next start waits until ``next_start_at``.
        self.start_failures: Counter[str] = Counter()
        self.next_start_at: dict[str, float] = {}
        #: variant -> replicas lost with a node and not yet replaced (``node_loss`` starts).
        self.lost_pending: Counter[str] = Counter()
        self.bg: set[asyncio.Task[None]] = set()
        self._seq = 0

    # --- lifecycle --------------------------------------------------------------------

    def start(self, a: StartReplica) -> Replica:
        st = self.state
        self._seq += 1
        rid = f"{a.variant}-{self._seq}"
        reason = StartReason.INITIAL
        if a.reason == "rollout":
            reason = StartReason.ROLLOUT
        elif self.lost_pending[a.variant] > 0:
            self.lost_pending[a.variant] -= 1
            reason = StartReason.NODE_LOSS
        elif a.reason == "scale_out":
            reason = StartReason.SCALE_OUT
        r = Replica(rid, a.variant, a.revision, a.node, self._seq, reason, template=a.template)
        st.replicas[rid] = r
        st.starts_total += 1
        task = asyncio.create_task(self._run(r), name=f"replica-{rid}")
        r.task = st.log.watch(task, f"replica {rid}")
        return r

    def drain(self, r: Replica, reason: str) -> None:
        """Start draining ``r`` in the background (out of the router first)."""
        r.phase = ReplicaPhase.DRAINING
        r.detail = f"draining: {reason}"
        self.state.say(f"draining {r.id} on {r.node} ({reason})")
        t = self.state.log.watch(
            asyncio.create_task(self._drain(r), name=f"drain-{r.id}"), f"drain of {r.id}"
        )
        self.bg.add(t)
        t.add_done_callback(self.bg.discard)

    async def lose_node(self, name: str) -> None:
        """The node is gone: its replicas die at once (the planner replaces them)."""
        for r in list(self.state.replicas.values()):
            if r.node == name and r.phase.live:
                self.lost_pending[r.variant] += 1
                if r.task is not None:
                    r.task.cancel()
                if r.child is not None:
                    await r.child.stop(sig=9)
                r.detail = f"lost with node {name}"

    async def stop_all(self) -> None:
        tasks = [r.task for r in self.state.replicas.values() if r.task is not None]
        tasks += list(self.bg)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await asyncio.gather(
            *(self.kill(r) for r in list(self.state.replicas.values())),
            return_exceptions=True,
        )

    # --- one replica ------------------------------------------------------------------

    async def _run(self, r: Replica) -> None:
        """Bring a replica up, record its start, then supervise it (restart on exit)."""
        try:
            await self._supervise(r)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Unexpected (``FleetLog.watch`` logs the traceback): a failed replica is
            # replaced by the planner instead of staying "starting" for ever.
            if r.phase is not ReplicaPhase.STOPPED:
                r.phase = ReplicaPhase.FAILED
                r.detail = "supervision failed unexpectedly; see the fleet log"
            self.state.wake()
            raise

    async def _supervise(self, r: Replica) -> None:
        st = self.state
        node = st.nodes[r.node]
        same_node_before = False
        while True:
            ctx = StartContext(
                reason=r.reason,
                node_had_revision=node.holds(r.revision),
                node_is_new=node.is_new,
                same_replica_on_node_before=same_node_before,
            )
            node.hosted_any = True
            ok = await self._start_once(r, node, ctx)
            if not ok:
                if r.phase is ReplicaPhase.STOPPED:
                    return
                r.phase = ReplicaPhase.FAILED
                self.start_failures[r.variant] += 1
                n = self.start_failures[r.variant]
                self.next_start_at[r.variant] = st.clock.now() + min(0.5 * 2 ** (n - 1), 30.0)
                return
            self.start_failures[r.variant] = 0
            same_node_before = True
            assert r.child is not None
            code = await r.child.proc.wait()
            if r.stopping or r.phase in (ReplicaPhase.DRAINING, ReplicaPhase.STOPPED):
                return
            # The process exited on its own: take it out of the router, restart it here.
            st.restarts_total += 1
            r.restarts += 1
            now = st.clock.now()
            r.restart_times.append(now)
            while r.restart_times and now - r.restart_times[0] > RESTART_WINDOW:
                r.restart_times.popleft()
            tail = r.child.tail(2)
            st.say(f"{r.id} on {r.node} exited with code {code}; restart {r.restarts}: {tail}")
            await self.unroute(r)
            if len(r.restart_times) > MAX_RESTARTS:
                self.start_failures[r.variant] += 1
                r.phase = ReplicaPhase.FAILED
                r.detail = f"crashed {len(r.restart_times)} times in {RESTART_WINDOW:.0f} s"
                st.wake()
                return
            r.phase = ReplicaPhase.STARTING
            r.detail = f"restarting after exit code {code}"
            r.reason = StartReason.RESTART
            st.wake()
            await asyncio.sleep(min(0.2 * 2 ** (r.restarts - 1), 5.0))

    async def _start_once(self, r: Replica, node: Node, ctx: StartContext) -> bool:
        assert self.session is not None
        st = self.state
        scheduled = st.clock.wall()
        weights_source = "cache"
        bytes_from: dict[str, int] = {}
        failure: str | None = None
        stamps: dict[str, float | None] = {}
        event_class = classify_start(ctx)
        image_source: str | None = None
        try:
            # Image: local mode has no container runtime; the start pulls it into the store.
            image = self.warmer.images.image_of(r)
            if image:
                img = await self.warmer.images.for_replica(r, node, image)
                image_source = img.source
                stamps["image_ready"] = img.ready
            # Weights: a lease on the node's snapshot, pulling it first on a cold node.
            if r.snapshot is None:
                snap = await asyncio.to_thread(node.cache.snapshot_dir, r.revision)
                if snap is None:
                    weights_source = "origin"
                    r.weights_source = "origin"
                    r.detail = "fetching weights (cold node): from peers, else the origin"
                    outcome = await self.warmer.pull_for_replica(r, node)
                    bytes_from = outcome.bytes_from
                    if bytes_from["peer"] and not bytes_from["origin"]:
                        weights_source = r.weights_source = "peer"
                    snap = outcome.snapshot
                else:
                    bytes_from = {"cache": st.rv(r.revision).model_bytes}
                r.lease = await asyncio.to_thread(node.cache.lease, r.revision, r.id)
                r.snapshot = snap
            else:
                bytes_from = {"cache": st.rv(r.revision).model_bytes}
            stamps["weights_ready"] = st.clock.wall()
            # Runtime.
            r.port = free_port()
            r.detail = "starting engine"
            r.child = await spawn(engine_argv(st, r), st.state_dir / "logs" / f"{r.id}.log")
            stamps["runtime_started"] = st.clock.wall()
            r.detail = "loading weights"
            healthy = await wait_http_ok(
                self.session, f"{r.url}/health", timeout=self.startup_timeout, child=r.child
            )
            if not healthy:
                failure = (
                    f"exited with code {r.child.proc.returncode}: {r.child.tail(3)}"
                    if not r.child.running
                    else f"not healthy within {self.startup_timeout:.0f} s"
                )
                raise ControlError(failure)
            stamps["healthy"] = st.clock.wall()
            stamps.update(await engine_stages(self.session, r))
            # First response, straight to the replica (the router adds it afterwards).
            await first_response(self.session, st.spec.name, r)
            stamps["first_response"] = st.clock.wall()
            r.phase = ReplicaPhase.READY
            r.detail = "ready; joining the router"
            st.wake()
            return True
        except asyncio.CancelledError:
            failure = failure or "cancelled"
            raise
        except (PreheatError, OSError, aiohttp.ClientError, TimeoutError) as exc:
            failure = redact_url(failure or f"{type(exc).__name__}: {exc}")
            r.detail = f"start failed: {failure}"
            if r.child is not None:
                await r.child.stop()
            if isinstance(exc, InsufficientSpace):
                r.phase = ReplicaPhase.FAILED
            st.wake()
            return False
        finally:
            self._record(
                r,
                scheduled,
                stamps,
                event_class,
                (image_source, weights_source),
                bytes_from,
                failure,
            )

    def _record(
        self,
        r: Replica,
        scheduled: float,
        stamps: dict[str, float | None],
        event_class: Any,
        sources: tuple[str | None, str],
        bytes_from: dict[str, int],
        failure: str | None,
    ) -> None:
        try:
            rec = start_record(
                self.state.spec.name, r, scheduled, stamps, event_class, sources, bytes_from,
                failure,
            )  # fmt: skip
            self.events.append(rec)  # the hook exports it to the fleet's metrics
        except ValueError as exc:
            self.state.say(f"could not record the start of {r.id}: {exc}")

    # --- router and stop --------------------------------------------------------------

    async def route(self, r: Replica) -> None:
        if r.phase is ReplicaPhase.READY and not r.routed:
            await self.router.add(r.variant, r.url)
            r.routed = True
            r.detail = "serving"
            self.state.say(f"{r.id} on {r.node} is in the router")

    async def unroute(self, r: Replica) -> None:
        if r.routed:
            r.routed = False
            with contextlib.suppress(ControlError):
                await self.router.remove(r.variant, r.url)

    async def _drain(self, r: Replica) -> None:
        """Out of the router first, then wait for in-flight requests, then stop."""
        if r.task is not None and not r.task.done() and not r.routed:
            r.task.cancel()
        if r.routed:
            with contextlib.suppress(ControlError):
                await self.router.drain(r.variant, r.url)
            await self._wait_idle(r)
        await self.kill(r)
        self.state.wake()

    async def _wait_idle(self, r: Replica) -> None:
        """Until the router reports no request in flight to this replica (or
        DRAIN_TIMEOUT): the router counts requests it has sent but not finished, which
        the engine alone cannot see."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_TIMEOUT
        while loop.time() < deadline and r.child is not None and r.child.running:
            try:
                config = await self.router.get_config()
            except ControlError:
                return
            busy = 0
            for v in config.get("variants", []):
                for inst in v.get("instances", []):
                    if isinstance(inst, dict) and inst.get("url") == r.url:
                        busy = int(inst.get("in_flight", 0))
            if busy == 0:
                return
            await asyncio.sleep(0.05)

    async def kill(self, r: Replica) -> None:
        """Stop the process, leave the router, release the lease; the replica is gone."""
        r.stopping = True
        if r.task is not None and r.task is not asyncio.current_task() and not r.task.done():
            r.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await r.task
        await self.unroute(r)
        if r.child is not None:
            await r.child.stop()
        if r.lease is not None:
            node = self.state.nodes[r.node]
            with contextlib.suppress(PreheatError, OSError):
                await asyncio.to_thread(node.cache.release, r.lease)
            r.lease = None
        r.phase = ReplicaPhase.STOPPED
        self.state.replicas.pop(r.id, None)
