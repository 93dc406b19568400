"""The simulated OpenAI-compatible inference engine: its aiohttp app and lifecycle.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming and
plain JSON), ``GET /v1/models``, ``GET /health`` (503 until the weights are read),
``GET /startup`` (start-stage timestamps), ``GET /metrics`` (Prometheus, vLLM names),
``POST /reset_prefix_cache``. The engine task that owns the scheduler is
``engine.task.EngineTask`` (this class's base); request validation and the answer bodies
are ``engine.openai_api``; the settings ``engine.config.EngineConfig``.

Error handling: bad requests are answered as ``engine.openai_api`` describes (a prompt
beyond the context 400); a client that disconnects mid-request (streaming or not) has its
sequence aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from preheat.errors import ConfigError

from .config import EngineConfig
from .core.chat import render_chat
from .core.tokenizer import filler_text
from .openai_api import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    BadRequest,
    error_response,
    prompt_tokens,
    read_body,
    request_params,
    sse_chunk,
    usage_body,
)
from .task import EngineTask

__all__ = ["EngineServer", "serve"]

log = logging.getLogger("preheat.engine")

_READ_CHUNK = 16 * 1024 * 1024


class EngineServer(EngineTask):
    """One simulated engine: scheduler, HTTP app, engine task, start stages."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.stages: dict[str, float] = {"runtime_started": config.runtime_started or time.time()}
        self.weights_bytes = 0
        self.weights_files = 0
        self.ready = False
        self._runner: web.AppRunner | None = None
        self.app = self._make_app()
        self._log_stage("runtime_started")

    # --- lifecycle ----------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._errors]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/startup", self.startup)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        return app

    async def start(self) -> None:
        """Start listening (``/health`` is 503 until :meth:`load_weights` finishes)."""
        self._engine_task = asyncio.create_task(self._engine_loop(), name="engine-loop")
        if self._kv_pub is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-replay")
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=1024)
        await site.start()
        log.info("listening on http://%s:%d", self.config.host, self.config.port)

    async def load_weights(self) -> None:
        """Read every file of the snapshot (really, at disk speed), then turn healthy."""
        snap = self.config.snapshot
        if snap is not None:
            self.weights_bytes, self.weights_files = await asyncio.to_thread(_read_all, snap)
        self.stages["weights_loaded"] = time.time()
        self._log_stage("weights_loaded")
        if self.config.warmup_s * self.time_scale > 0:
            await asyncio.sleep(self.config.warmup_s * self.time_scale)
        self.ready = True
        self.stages["healthy"] = time.time()
        self._log_stage("healthy")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._kv_pub is not None:
            self._kv_pub.close()

    def _log_stage(self, stage: str) -> None:
        line = {"event": "start_stage", "stage": stage, "t": self.stages.get(stage, time.time())}
        if stage == "weights_loaded":
            line["weights_bytes"] = self.weights_bytes
        log.info("%s", json.dumps(line))

    # --- HTTP ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, exc.param)
        except web.HTTPNotFound:
            return error_response(404, f"no route {request.method} {request.path}")
        except web.HTTPMethodNotAllowed:
            return error_response(405, f"method {request.method} not allowed on {request.path}")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(
            request, max_body_bytes=self.config.max_body_bytes, model=self.model, ready=self.ready
        )
        tokens = prompt_tokens(self.tokenizer, body.get("prompt"))
        max_tokens, stream, include_usage, salt = request_params(
            body, DEFAULT_COMPLETION_MAX_TOKENS
        )
        return await self._generate(
            request, tokens, max_tokens, stream, include_usage, salt, chat=False
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(
            request, max_body_bytes=self.config.max_body_bytes, model=self.model, ready=self.ready
        )
        if "messages" not in body:
            raise BadRequest(400, "'messages' is required", "messages")
        try:
            text = render_chat(body["messages"], body.get("tools"))
        except ConfigError as exc:
            param = str(exc).split(" ", 1)[0]
            raise BadRequest(
                400, str(exc), param if param.startswith(("messages", "tools")) else "messages"
            ) from exc
        tokens = self.tokenizer.encode(text)
        max_tokens, stream, include_usage, salt = request_params(body, DEFAULT_CHAT_MAX_TOKENS)
        return await self._generate(
            request, tokens, max_tokens, stream, include_usage, salt, chat=True
        )

    async def _generate(
        self,
        request: web.Request,
        tokens: list[int],
        max_tokens: int,
        stream: bool,
        include_usage: bool,
        salt: str | None,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        req_id, sink = self._submit(
            tokens, max_tokens, stream, salt, "messages" if chat else "prompt"
        )
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req_id}"
        created = int(time.time())
        finished = False
        try:
            if not stream:
                assert sink.done is not None
                out = await sink.done
                finished = True
                text = filler_text(0, out.num_output_tokens)
                choice: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": out.finish_reason,
                    "logprobs": None,
                }
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                return web.json_response(
                    {
                        "id": rid,
                        "object": "chat.completion" if chat else "text_completion",
                        "created": created,
                        "model": self.model,
                        "choices": [choice],
                        "usage": usage_body(out),
                    }
                )
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            obj = "chat.completion.chunk" if chat else "text_completion"
            head = f'{{"id":"{rid}","object":"{obj}","created":{created},"model":{json.dumps(self.model)},'
            if chat:
                await resp.write(
                    sse_chunk(
                        head,
                        [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                    )
                )
            assert sink.queue is not None
            while True:
                item = await sink.queue.get()
                if item is None:  # the engine step failed (logged by the engine loop)
                    finished = True
                    err = {"message": "the engine step failed unexpectedly; retry the request"}
                    await resp.write(b"event: error\ndata: " + json.dumps({"error": err}).encode())
                    await resp.write(b"\n\n")
                    await resp.write_eof()
                    return resp
                out = item
                pos = out.num_output_tokens - len(out.new_token_ids)
                piece = filler_text(pos, len(out.new_token_ids))
                c: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason}
                if chat:
                    c["delta"] = {"content": piece}
                else:
                    c["text"] = piece
                    c["logprobs"] = None
                await resp.write(sse_chunk(head, [c]))
                if out.finished:
                    finished = True
                    if include_usage:
                        await resp.write(sse_chunk(head, [], usage=usage_body(out)))
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    return resp
        finally:
            if not finished:
                self._abort(req_id)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": int(self.stages["runtime_started"]),
                        "owned_by": "preheat",
                        "root": self.model,
                        "max_model_len": self.profile.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return error_response(503, "Loading model")
        return web.Response(status=200)

    async def startup(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "stages": self.stages,
                "ready": self.ready,
                "weights_bytes": self.weights_bytes,
                "weights_files": self.weights_files,
                "snapshot": str(self.config.snapshot) if self.config.snapshot else None,
                "model": self.model,
                "profile": self.profile.name,
                "pid": os.getpid(),
                "time_scale": self.time_scale,
                "kv_blocks": self.sched.kv.num_blocks,
                "block_size": self.sched.kv.block_size,
            }
        )

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.sched.kv.reset()
        self._publish_kv()
        return web.Response(status=200)


def _read_all(root: Path) -> tuple[int, int]:
    """Read every regular file under ``root`` completely; returns (bytes, files)."""
    total = files = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
        files += 1
    return total, files


async def serve(
    config: EngineConfig, *, ready: Callable[[EngineServer], None] | None = None
) -> None:
    """Run an engine until SIGINT/SIGTERM: listen, read weights, turn healthy, serve."""
    import signal

    server = EngineServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    try:
        await server.load_weights()
        if ready is not None:
            ready(server)
        await stop.wait()
    finally:
        await server.close()


def run(config: EngineConfig) -> None:
    """Blocking entry point: uvloop when available, logs to stderr."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(serve(config))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(config))
