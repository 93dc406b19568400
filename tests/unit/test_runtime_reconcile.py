"""The reconcile loop and its executor contract: every action kind has a method, and an
unexpected exception is logged with its traceback without stopping the pass or loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, get_args

from preheat.control import state
from preheat.control.state import Desired, DesiredVariant, NodeView, Observed, StartReplica
from preheat.runtime.fleetlog import FleetLog
from preheat.runtime.local_executor import LocalExecutor
from preheat.runtime.reconcile import HANDLERS, Executor, ReconcileLoop, unhandled


def test_every_action_kind_has_an_executor_method() -> None:
    """Each action type of ``control.state`` maps to a method that the protocol declares
    and the local executor implements."""
    assert unhandled() == []
    for name in HANDLERS.values():
        assert callable(getattr(Executor, name)) and callable(getattr(LocalExecutor, name))


def test_the_action_type_alias_names_exactly_the_action_types() -> None:
    """``Action`` (quoted, for Python 3.9) evaluates to the union of ``ACTION_TYPES``."""
    alias = eval(state.Action, vars(state))
    assert set(get_args(alias)) == set(state.ACTION_TYPES)
    assert len(state.ACTION_TYPES) == len(set(state.ACTION_TYPES)) == 13


class _Recorder:
    """An executor over a fixed world: two empty nodes, one variant wanting 2 replicas;
    ``start_replica`` fails on its first call, ``observe`` on chosen passes."""

    def __init__(self, fail_observe_on: set[int]) -> None:
        self.calls: list[Any] = []
        self.observed = 0
        self.fail_observe_on = fail_observe_on

    async def observe(self) -> tuple[Desired, Observed] | None:
        self.observed += 1
        if self.observed in self.fail_observe_on:
            raise KeyError("injected observe fault")
        desired = Desired("chat", (DesiredVariant("main", "rev1", 1000, 2),))
        observed = Observed(now=0.0, nodes=(NodeView("a"), NodeView("b")))
        return desired, observed

    async def start_replica(self, action: StartReplica) -> None:
        self.calls.append(action)
        if len(self.calls) == 1:
            raise RuntimeError("injected start fault")

    def __getattr__(self, name: str) -> Any:
        async def record(action: Any) -> None:
            self.calls.append(action)

        return record


async def test_loop_logs_faults_with_traceback_and_keeps_going(tmp_path: Path) -> None:
    """A failing action does not stop the rest of its pass, a failing observe does not
    stop the loop, and both land in the log file with their tracebacks."""
    log = FleetLog(tmp_path / "fleet.log")
    ex = _Recorder(fail_observe_on={2})
    loop = ReconcileLoop(ex, log, tick=0.01)  # type: ignore[arg-type]
    loop.start()
    try:
        for _ in range(500):
            if loop.passes >= 4:
                break
            await asyncio.sleep(0.01)
    finally:
        await loop.stop()
        log.close()
    assert loop.passes >= 4
    starts = [c for c in ex.calls if isinstance(c, StartReplica)]
    # Pass 1: both starts attempted although the first raised; pass 2 observed nothing.
    assert len(starts) >= 4 and {s.node for s in starts[:2]} == {"a", "b"}
    assert log.errors == 2
    text = (tmp_path / "fleet.log").read_text()
    assert text.count("Traceback (most recent call last)") == 2
    assert "RuntimeError: injected start fault" in text
    assert "KeyError: 'injected observe fault'" in text
    assert any("reconcile: StartReplica failed" in m for m in log.messages)


def test_repeated_error_logged_once_then_counted(tmp_path: Path) -> None:
    """The same unexpected error on every tick writes one traceback, not one per tick;
    a different error is logged in full and reports how often the first repeated."""
    log = FleetLog(tmp_path / "fleet.log")

    def fail(exc: Exception) -> None:
        try:
            raise exc
        except Exception as caught:
            log.error("reconcile: observe failed", caught)

    for _ in range(5):
        fail(OSError("disk gone"))
    fail(ValueError("other"))
    log.close()
    text = (tmp_path / "fleet.log").read_text()
    assert log.errors == 6
    assert text.count("Traceback (most recent call last)") == 2
    assert "repeated 4 more time(s)" in text
