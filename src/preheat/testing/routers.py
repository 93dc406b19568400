"""Start a real ``preheat router serve`` process on 127.0.0.1 for tests and benchmarks.

::

    with start_router(backends=[engine_url], strategy="prefix_aware", admin_token="t") as r:
        httpx.post(r.url + "/v1/completions", json={...})
        r.admin("GET", "/admin/config")

The process is stopped by its PID (SIGTERM, then SIGKILL) when the block ends, or by
``RouterProcess.stop()``. Peer routers (sglang-router, vllm-router) for comparisons
start the same way with ``start_peer_router``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .procs import Process, free_port, start_server

DEFAULT_SALT = "preheat-test-salt-0123456789abcdef"

#: Peer routers for comparisons: kind -> (command, log level flag value). Both start with
#: their own default retries (no ``--disable-retries``): a benchmark compares what users run.
PEER_ROUTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "sglang": (("sglang-router", "launch"), "warn"),
    "vllm": (("vllm-router",), "warning"),
}


@dataclass
class RouterProcess:
    """A running router process: its URL, PID and admin token."""

    process: Process
    port: int
    admin_token: str | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.process.popen

    def admin(self, method: str, path: str, body: Any = None, *, token: str | None = None) -> Any:
        """Call the admin API; returns the decoded JSON (raises HTTPError on >= 400)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin_token}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        """SIGTERM the process by PID, SIGKILL it after 5 s; safe to call twice."""
        self.process.stop(5)


def _serve(
    argv_for: Any,
    *,
    port: int | None,
    log_path: Path | None,
    timeout: float,
    env: dict[str, str] | None = None,
    inherit_env: bool = True,
    what: str,
    admin_token: str | None = None,
) -> RouterProcess:
    proc, p = start_server(
        argv_for,
        port=port,
        log=log_path,
        env=env,
        inherit_env=inherit_env,
        timeout=timeout,
        what=what,
    )
    return RouterProcess(process=proc, port=p, admin_token=admin_token, log_path=log_path)


def launch_router(
    *,
    backends: Sequence[str] = (),
    strategy: str = "random",
    config: str | Path | None = None,
    port: int | None = None,
    admin_token: str | None = None,
    salt: str = DEFAULT_SALT,
    prefix_length: int | None = None,
    concurrency_threshold: int | None = None,
    decision_log: str | Path | None = None,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    timeout: float = 30.0,
) -> RouterProcess:
    """Start ``preheat router serve`` and wait for ``/health``; the caller must ``stop()`` it."""

    def argv(p: int) -> list[str]:
        cmd = [str(Path(sys.executable).parent / "preheat"), "router", "serve", "--port", str(p)]
        if config is not None:
            cmd += ["--config", str(config)]
        else:
            cmd += ["--strategy", strategy]
            for b in backends:
                cmd += ["--backend", b]
            if prefix_length is not None:
                cmd += ["--prefix-length", str(prefix_length)]
            if concurrency_threshold is not None:
                cmd += ["--concurrency-threshold", str(concurrency_threshold)]
        if decision_log is not None:
            cmd += ["--decision-log", str(decision_log)]
        return [*cmd, "--log-level", "WARNING", *extra_args]

    env = dict(os.environ)
    env["PREHEAT_ROUTER_SALT"] = salt
    env.pop("PREHEAT_ADMIN_TOKEN", None)
    if admin_token is not None:
        env["PREHEAT_ADMIN_TOKEN"] = admin_token
    return _serve(
        argv,
        port=port,
        log_path=log_path,
        timeout=timeout,
        env=env,
        inherit_env=False,
        what="preheat router",
        admin_token=admin_token,
    )


@contextlib.contextmanager
def start_router(**kwargs: Any) -> Iterator[RouterProcess]:
    """``launch_router`` as a context manager that stops the process by PID on exit."""
    r = launch_router(**kwargs)
    try:
        yield r
    finally:
        r.stop()


def peer_router_argv(
    kind: str, port: int, backends: Sequence[str], *, policy: str, prometheus_port: int
) -> list[str]:
    """The command line of a peer router: its defaults except address, policy, workers and
    log level (retries and circuit breaker as shipped)."""
    if kind not in PEER_ROUTERS:
        raise ValueError(f"peer router {kind!r} is unknown; use one of {sorted(PEER_ROUTERS)}")
    exe, log_level = PEER_ROUTERS[kind]
    cmd = [str(Path(sys.executable).parent / exe[0]), *exe[1:]]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
    return [*cmd, "--worker-urls", *backends, "--log-level", log_level]


@contextlib.contextmanager
def start_peer_router(
    kind: str,
    backends: Sequence[str],
    *,
    policy: str = "cache_aware",
    port: int | None = None,
    log_path: Path | None = None,
    timeout: float = 60.0,
) -> Iterator[RouterProcess]:
    """Start ``sglang-router`` or ``vllm-router`` (from the venv) in front of ``backends``
    with their default retry and circuit-breaker settings (as a user would run them)."""
    prometheus = free_port()  # each peer also opens one (29000 by default): its own

    def argv(p: int) -> list[str]:
        return peer_router_argv(kind, p, backends, policy=policy, prometheus_port=prometheus)

    r = _serve(argv, port=port, log_path=log_path, timeout=timeout, what=f"{kind}-router")
    try:
        yield r
    finally:
        r.stop()


# --- a fast OpenAI-compatible backend (for proxy tests and the overhead benchmark) ---------


def fast_backend_app(name: str = "backend") -> Any:
    """An aiohttp app that answers OpenAI calls at once; the body's ``preheat_test``
    object steers faults: ``{"hang_s": 5}``, ``{"die_after": 2}`` (chunks, then the
    connection is cut), ``{"status": 500}``. ``POST /control {"healthy": false}`` makes
    ``/health`` fail; ``GET /stats`` counts requests."""
    import asyncio

    from aiohttp import web

    state = {"healthy": True, "requests": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        state["requests"] += 1
        test = body.get("preheat_test") or {}
        if test.get("hang_s"):
            await asyncio.sleep(float(test["hang_s"]))
        if test.get("status"):
            return web.json_response({"error": {"message": "injected"}}, status=test["status"])
        chunks = int(body.get("max_tokens") or 3)
        usage = {
            "prompt_tokens": 10,
            "completion_tokens": chunks,
            "total_tokens": 10 + chunks,
            "prompt_tokens_details": {"cached_tokens": 7},
        }
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(chunks):
                if test.get("die_after") is not None and i >= int(test["die_after"]):
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                chunk = {"id": "c", "backend": name, "choices": [{"index": 0, "text": f"t{i}"}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(float(test.get("chunk_gap_s", 0)))
            final = {"id": "c", "backend": name, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {
                "id": "c",
                "object": "text_completion",
                "backend": name,
                "body_sha256": hashlib.sha256(raw).hexdigest(),
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": usage,
            }
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": state["healthy"]}, status=200 if state["healthy"] else 503)

    async def control(request: web.Request) -> web.Response:
        state.update(await request.json())
        return web.json_response(state)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(state)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/generate", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/control", control)
    app.router.add_get("/stats", stats)
    return app


@contextlib.contextmanager
def start_fast_backend(port: int | None = None) -> Iterator[RouterProcess]:
    """Run ``fast_backend_app`` in its own process (uvloop) on 127.0.0.1."""
    r = _serve(
        lambda p: [sys.executable, "-m", "preheat.testing.routers", "--port", str(p)],
        port=port,
        log_path=None,
        timeout=30.0,
        what="fast backend",
    )
    try:
        yield r
    finally:
        r.stop()


def _main(argv: Sequence[str]) -> None:
    import argparse

    from aiohttp import web

    ap = argparse.ArgumentParser(description="a fast fake OpenAI backend for router tests")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    web.run_app(
        fast_backend_app(f"b{args.port}"),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        loop=loop_factory() if loop_factory else None,
    )


if __name__ == "__main__":
    _main(sys.argv[1:])
