"""The reconcile loop (observe -> ``control.plan`` -> execute) and the executor it drives.

One loop serves every mode; what differs is the ``Executor``: local mode's
(``runtime.local_executor.LocalExecutor``: node stores on disk, replica processes, a
router child) and Kubernetes mode's (``runtime.kubernetes.k8s_executor.KubeExecutor``:
ModelDataCaches, Deployments, Services). The behaviour is the planner's (``control.plan``); an executor only reports the
world and carries out actions.

The contract for an implementation:

``observe() -> (Desired, Observed) | None``
    Bring the executor's view up to date and return what the planner needs: ``Desired``
    (each variant's resolved, immutable revision, its replica count, template and the
    weights policy) and ``Observed`` (``now`` on the executor's clock; every node with
    ``up``, ``slots``, ``target`` and a ``CacheView`` per revision it touched; every
    replica that is not stopped, with its phase and whether it is routed; each variant's
    ``VariantStatus`` memory: stable version, failed versions, opened gates). Work in
    flight must be visible (a cache ``warming``, a replica ``starting``) so the next tick
    does not start it twice. ``None`` means nothing can be planned yet (e.g. the source
    does not resolve); the executor says why in its status. Sampling for autoscaling
    belongs here too: it sets the replica counts that ``Desired`` carries.

One method per action kind (``HANDLERS`` maps each ``control.state`` action type to
its method). Every action must be **idempotent**: the planner is level-triggered and
re-emits an action until the observed state shows it done, and a tick may repeat one
that was already started. Long work (downloads, process starts, drains) must not block
the loop: start it as a background task and return; its progress shows up in the next
``observe``.

- ``warm(Warm)``: fill ``revision`` into ``node``'s cache (no-op if already warming);
  failures become ``failed``/``unfit`` cache views with the reason and a ``retry_at``.
- ``wait_gate(WaitGate)``: replicas of the revision wait until ``needed`` target nodes
  hold it: remember when the wait began (``VariantStatus.gate_since``) and show why.
- ``open_gate(OpenGate)``: latch the gate open for the revision (``gate_open``).
- ``start_replica(StartReplica)``: create one replica of ``variant``/``revision`` on
  ``node`` (honouring any start backoff: then only say why it waits).
- ``unschedulable(Unschedulable)``: show that ``missing`` replicas cannot be placed.
- ``add_route(AddRoute)``: put a ready replica into the router (no-op if routed).
- ``drain(Drain)``: out of the router, let in-flight requests finish, then stop it.
- ``stop_replica(StopReplica)``: stop at once (lost node, failed replica) and release
  whatever it held (leases).
- ``finish_rollout(FinishRollout)``: the version becomes the variant's ``stable``.
- ``rollback(Rollback)``: mark the version failed (never retried until the spec changes).
- ``delete_revision(DeleteRevision)``: drop an unused revision from the node's cache.
- ``notice(Notice)``: show an operator-facing message.
- ``revoked(Revoked)``: the variant's revision is revoked: show it (Degraded) with the
  planner's message; the roll to the fallback, if any, is ordinary actions that follow.

Optional: ``commit()``, called after every pass (also one where ``observe`` returned
``None``): publish what the pass did in one go (Kubernetes mode writes the objects'
status and posts Events there). Local mode has none.

Errors: an exception from ``observe`` or from one action is unexpected; the loop logs
it with its traceback (``FleetLog.error``), carries on with the next action, and plans
again at the next tick. It never stops while the fleet runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Protocol

from preheat.control.plan import plan
from preheat.control.state import (
    ACTION_TYPES,
    Action,
    AddRoute,
    DeleteRevision,
    Desired,
    Drain,
    FinishRollout,
    Notice,
    Observed,
    OpenGate,
    Revoked,
    Rollback,
    StartReplica,
    StopReplica,
    Unschedulable,
    WaitGate,
    Warm,
)
from preheat.runtime.fleetlog import FleetLog

__all__ = ["HANDLERS", "Executor", "ReconcileLoop", "execute", "unhandled"]


class Executor(Protocol):
    """What the reconcile loop drives (see the module docstring for the contract)."""

    async def observe(self) -> tuple[Desired, Observed] | None: ...
    async def warm(self, action: Warm, /) -> None: ...
    async def wait_gate(self, action: WaitGate, /) -> None: ...
    async def open_gate(self, action: OpenGate, /) -> None: ...
    async def start_replica(self, action: StartReplica, /) -> None: ...
    async def unschedulable(self, action: Unschedulable, /) -> None: ...
    async def add_route(self, action: AddRoute, /) -> None: ...
    async def drain(self, action: Drain, /) -> None: ...
    async def stop_replica(self, action: StopReplica, /) -> None: ...
    async def finish_rollout(self, action: FinishRollout, /) -> None: ...
    async def rollback(self, action: Rollback, /) -> None: ...
    async def delete_revision(self, action: DeleteRevision, /) -> None: ...
    async def notice(self, action: Notice, /) -> None: ...
    async def revoked(self, action: Revoked, /) -> None: ...


#: Action type -> the ``Executor`` method that carries it out.
HANDLERS: Mapping[type, str] = {
    Warm: "warm",
    WaitGate: "wait_gate",
    OpenGate: "open_gate",
    StartReplica: "start_replica",
    Unschedulable: "unschedulable",
    AddRoute: "add_route",
    Drain: "drain",
    StopReplica: "stop_replica",
    FinishRollout: "finish_rollout",
    Rollback: "rollback",
    DeleteRevision: "delete_revision",
    Notice: "notice",
    Revoked: "revoked",
}


def unhandled() -> list[str]:
    """Action types of ``control.state`` that no executor method carries out (none)."""
    return sorted(t.__name__ for t in set(ACTION_TYPES) - set(HANDLERS))


async def execute(executor: Executor, action: Action) -> None:
    """Carry out one action through the executor's method for its type."""
    await getattr(executor, HANDLERS[type(action)])(action)


class ReconcileLoop:
    """Runs ``observe -> plan -> execute`` every ``tick`` seconds, or sooner on ``wake``.

    ``lock`` is held for each pass, so a caller that changes what ``observe`` reads
    (a spec apply) can do it between passes.
    """

    def __init__(self, executor: Executor, log: FleetLog, *, tick: float = 0.2) -> None:
        self.executor = executor
        self.log = log
        self.tick = tick
        self.lock = asyncio.Lock()
        #: Completed passes (with or without an error).
        self.passes = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="preheat-reconcile")

    async def stop(self) -> None:
        # The flag as well as the cancel: on Python 3.11 ``wait_for`` may swallow a
        # cancellation that arrives as its wait ends, and the loop would go on.
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def run(self) -> None:
        while not self._stopping:
            async with self.lock:
                await self.once()
            self.passes += 1
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick)

    async def once(self) -> None:
        """One pass; unexpected exceptions are logged with a traceback, never raised."""
        try:
            state = await self.executor.observe()
        except Exception as exc:
            self.log.error("reconcile: observe failed", exc)
            return
        if state is None:
            await self._commit()
            return
        try:
            actions = plan(*state)
        except Exception as exc:
            self.log.error("reconcile: plan failed", exc)
            return
        for action in actions:
            try:
                await execute(self.executor, action)
            except Exception as exc:
                self.log.error(f"reconcile: {type(action).__name__} failed", exc)
        await self._commit()

    async def _commit(self) -> None:
        # Looked up on the class: the hook is part of an executor's definition, and a
        # catch-all ``__getattr__`` (test doubles) must not turn into one.
        if getattr(type(self.executor), "commit", None) is None:
            return
        try:
            await self.executor.commit()  # type: ignore[attr-defined]
        except Exception as exc:
            self.log.error("reconcile: commit failed", exc)
