"""A replica's engine process as the supervisor (``runtime.replicas``) drives it: the
command line it is started with, the start stages it reports, and its first request.

- ``engine_argv``: the spec's ``engine.command`` with ``{snapshot}``, ``{port}``,
  ``{host}``, ``{model}`` and ``{replica}`` filled in (shell-quoted), or ``preheat engine
  serve`` for the simulated engine; the replica's template (its version) picks the
  engine, so a replica keeps running the engine it was started with during a rollout.
- ``engine_stages``: ``runtime_started`` / ``weights_loaded`` from the engine's own
  ``GET /startup`` (absent or unreadable: no stages, never a failed start).
- ``first_response``: one completion straight to the replica before the router adds it.
"""

from __future__ import annotations

import shlex

import aiohttp

from preheat.control.spec import CommandEngine, SimulatedEngine
from preheat.errors import ControlError
from preheat.runtime.model import FleetState, Replica
from preheat.runtime.procs import preheat_command

__all__ = ["engine_argv", "engine_stages", "first_response"]


def engine_argv(st: FleetState, r: Replica) -> list[str]:
    """The command line of ``r``'s engine (module docstring)."""
    engine = st.templates[r.template][0] if r.template in st.templates else None
    if engine is None:
        engine = st.spec.variant(r.variant).engine
    assert r.snapshot is not None
    if isinstance(engine, CommandEngine):
        text = engine.command.format(
            snapshot=shlex.quote(str(r.snapshot)),
            port=r.port,
            host="127.0.0.1",
            model=shlex.quote(st.spec.name),
            replica=r.id,
        )
        return shlex.split(text)
    assert isinstance(engine, SimulatedEngine)
    argv = preheat_command(
        "engine",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(r.port),
        "--profile",
        engine.profile,
        "--snapshot",
        str(r.snapshot),
        "--time-scale",
        str(engine.time_scale),
        "--model-name",
        st.spec.name,
    )
    if engine.kv_blocks is not None:
        argv += ["--kv-blocks", str(engine.kv_blocks)]
    return argv


async def engine_stages(session: aiohttp.ClientSession, r: Replica) -> dict[str, float | None]:
    """``runtime_started`` / ``weights_loaded`` as the engine reports them (``/startup``)."""
    try:
        async with session.get(f"{r.url}/startup") as resp:
            if resp.status != 200:
                return {}
            data = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}
    stages = data.get("stages", data) if isinstance(data, dict) else {}
    out: dict[str, float | None] = {}
    for name in ("runtime_started", "weights_loaded"):
        v = stages.get(name) if isinstance(stages, dict) else None
        if isinstance(v, int | float):
            out[name] = float(v)
    return out


async def first_response(session: aiohttp.ClientSession, model: str, r: Replica) -> None:
    """One completion straight to ``r``; ControlError with the answer if it is not 200."""
    body = {"model": model, "prompt": "preheat warm-up", "max_tokens": 1}
    async with session.post(f"{r.url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            text = await resp.text()
            raise ControlError(f"first request -> {resp.status}: {text[:200]}")
        await resp.read()
