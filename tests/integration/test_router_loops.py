"""Background loops survive unexpected exceptions: the router's health checker and the
simulated engine's scheduling loop log a traceback and keep running."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from preheat.engine.config import EngineConfig
from preheat.engine.server import EngineServer
from preheat.router.config import parse_config
from preheat.router.health import HealthChecker
from preheat.router.state import RoutingState
from preheat.testing.routers import fast_backend_app
from preheat.timing import PROFILES

POISON = 987_654_321  # a token id that makes the injected fault fire


@pytest.fixture
async def backends() -> AsyncIterator[list[str]]:
    servers = []
    for i in range(2):
        s = TestServer(fast_backend_app(f"b{i}"), host="127.0.0.1")
        await s.start_server()
        servers.append(s)
    yield [str(s.make_url("")).rstrip("/") for s in servers]
    for s in servers:
        await s.close()


async def test_the_health_loop_logs_a_fault_and_keeps_checking(
    backends: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A probe that raises something unexpected (here from an aiohttp trace hook, a public
    seam of the client) is logged with its traceback, counts as a failed check, and the
    loop goes on probing: another instance that fails its /health is still taken out."""
    bad, good = backends

    async def explode(session: Any, ctx: Any, params: aiohttp.TraceRequestStartParams) -> None:
        if str(params.url).startswith(bad):
            raise RuntimeError("injected fault in the health probe")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(explode)
    cfg = parse_config(
        {
            "variants": [{"name": "v", "instances": [bad, good]}],
            "health": {"interval_s": 0.05, "timeout_s": 1, "failures": 2},
        }
    )
    state = RoutingState(cfg, salt=b"0123456789abcdef", rng=random.Random(0))
    caplog.set_level(logging.WARNING, logger="preheat.router")
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        task = asyncio.create_task(HealthChecker(state, session).run())
        try:
            await asyncio.sleep(0.5)
            assert not task.done(), task.exception() if task.done() else None
            assert state.find(bad).state == "unhealthy"  # type: ignore[union-attr]
            assert state.find(good).state == "healthy"  # type: ignore[union-attr]
            async with session.post(good + "/control", json={"healthy": False}):
                pass
            for _ in range(100):
                if state.find(good).state == "unhealthy":  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.05)
            assert state.find(good).state == "unhealthy"  # type: ignore[union-attr]
            assert not task.done()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    faults = [r for r in caplog.records if "injected fault" in (r.exc_text or "")]
    assert faults, [r.getMessage() for r in caplog.records]
    assert len(faults) == 1  # once per instance and kind of fault, not every round
    assert "Traceback" in (faults[0].exc_text or "")


async def test_the_engine_loop_logs_a_fault_and_keeps_serving(
    free_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A step that raises inside the scheduling loop (a fault injected through the public
    ``sched`` for requests with a poison token) fails that step's requests with a 500 or
    an SSE error event, is logged with a traceback, and later requests are served."""
    server = EngineServer(EngineConfig(profile=PROFILES["tiny"], port=free_port, time_scale=0))
    real_complete = server.sched.complete

    def complete(step: Any, now: float) -> Any:
        if any(POISON in seq.prompt_tokens for seq, _ in step.scheduled):
            raise RuntimeError("injected fault in a scheduler step")
        return real_complete(step, now)

    server.sched.complete = complete  # type: ignore[method-assign]
    caplog.set_level(logging.ERROR, logger="preheat.engine")
    await server.start()
    await server.load_weights()
    url = f"http://127.0.0.1:{free_port}/v1/completions"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.post(url, json={"prompt": [1, 2, POISON], "max_tokens": 3}) as resp:
                assert resp.status == 500
                err = (await resp.json())["error"]
                assert "engine step failed" in err["message"]
            body = {"prompt": [4, POISON], "max_tokens": 3, "stream": True}
            async with s.post(url, json=body) as resp:
                text = await resp.text()
            assert "event: error" in text and "engine step failed" in text
            for _ in range(3):
                async with s.post(url, json={"prompt": "fine", "max_tokens": 2}) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["usage"]["completion_tokens"] == 2
        assert server.sched.num_running == 0 and server.sched.num_waiting == 0
        assert server._engine_task is not None and not server._engine_task.done()
    finally:
        await server.close()
    faults = [r for r in caplog.records if "injected fault" in (r.exc_text or "")]
    assert len(faults) == 2 and "Traceback" in (faults[0].exc_text or "")
