"""The simulated OpenAI-compatible inference engine: an aiohttp server over the pure core.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming and
plain JSON), ``GET /v1/models``, ``GET /health`` (503 until the weights are read),
``GET /startup`` (start-stage timestamps), ``GET /metrics`` (Prometheus, vLLM names),
``POST /reset_prefix_cache``.

Resource handling: one engine task owns the scheduler. It plans a step, sleeps
``step.duration x time_scale`` against a running deadline (so timer slack does not
accumulate), applies the step and hands each request its new tokens. ``time_scale 0``
never sleeps: steps run back to back, yielding to the event loop in between.

Error handling: every bad request gets an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``: malformed JSON 400, a missing or
wrong-typed field 400 naming it, a prompt beyond the context 400, a body over
``max_body_bytes`` 413, an unknown model 404. A client that disconnects mid-request
(streaming or not) has its sequence aborted and its KV blocks freed. An unexpected
exception inside a scheduling step is logged with its traceback; the step's requests
(every request in the engine when planning itself failed) are aborted and answered 500
(or end their stream with an ``error`` event), and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from preheat.errors import ConfigError, PromptTooLong
from preheat.kvhash import make_scheme
from preheat.timing import EngineProfile

from .core.chat import render_chat
from .core.scheduler import Scheduler, SeqOutput
from .core.tokenizer import Tokenizer, filler_text
from .kvevents import ExternalHashes, KVEventPublisher, batch_events, parse_options
from .metrics import EngineMetrics

__all__ = ["EngineConfig", "EngineServer", "serve"]

log = logging.getLogger("preheat.engine")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 128
_READ_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``preheat engine serve`` accepts; validated by the CLI."""

    profile: EngineProfile
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    """Served model name; default: the profile's model."""
    snapshot: Path | None = None
    """A directory of weight files to read completely before turning healthy."""
    kv_blocks: int | None = None
    time_scale: float = 1.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    enable_prefix_caching: bool = True
    warmup_s: float = 0.0
    """Simulated runtime warm-up between weights_loaded and healthy (KV allocation, CUDA
    graph capture: tens of seconds in vLLM); scaled by ``time_scale`` like every step."""
    runtime_started: float | None = None
    """Epoch time the process started; default: when the server object is made."""
    kv_events: str | None = None
    """Publish KV-cache events as vLLM does (ZMQ PUB bound here, e.g. tcp://127.0.0.1:5557,
    with ``?hash=...&hash_seed=...&replay=tcp://...`` options; engine/kvevents.py); None: off."""
    kv_events_pod: str | None = None
    """The ``<pod>`` of the event topic ``kv@<pod>@<model>``; default host:port."""

    @property
    def served_model(self) -> str:
        return self.model_name or self.profile.model


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    code: str | int = {404: "model_not_found"}.get(status, status)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


@dataclass(eq=False)
class _Sink:
    """Where the engine task delivers one request's tokens."""

    stream: bool
    queue: asyncio.Queue[SeqOutput | None] | None = None
    done: asyncio.Future[SeqOutput] | None = None
    last: SeqOutput | None = None
    arrival: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class EngineServer:
    """One simulated engine: scheduler, HTTP app, engine task, start stages."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.profile = config.profile
        self.model = config.served_model
        self.sched = Scheduler(
            config.profile,
            kv_blocks=config.kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.tokenizer = Tokenizer()
        self.metrics = EngineMetrics(self.sched, self.model)
        self.time_scale = config.time_scale
        self.stages: dict[str, float] = {"runtime_started": config.runtime_started or time.time()}
        self.weights_bytes = 0
        self.weights_files = 0
        self.ready = False
        self._sinks: dict[Hashable, _Sink] = {}
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._engine_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._kv_pub: KVEventPublisher | None = None
        self._kv_tokens: dict[Hashable, tuple[list[int], int, str | None]] = {}
        self._kv_ext: ExternalHashes | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if config.kv_events:
            opts = parse_options(config.kv_events)
            pod = config.kv_events_pod or f"{config.host}:{config.port}"
            self._kv_pub = KVEventPublisher(
                opts.endpoint,
                f"kv@{pod}@{self.model}",
                replay=opts.replay,
                block_size=self.sched.kv.block_size,
                buffer_steps=opts.buffer_steps,
            )
            self._kv_ext = ExternalHashes(make_scheme(opts.hash, opts.hash_seed))
            self.sched.kv.events = []
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

    async def _serve_replay(self) -> None:
        """Answer KV-event replay requests every 50 ms; changes not yet published are
        published first, so a snapshot is the cache as of its sequence number."""
        pub = self._kv_pub
        assert pub is not None
        while True:
            await asyncio.sleep(0.05)
            if pub.replay_waiting():
                self._publish_kv()
                pub.serve_replay()

    def _log_stage(self, stage: str) -> None:
        line = {"event": "start_stage", "stage": stage, "t": self.stages.get(stage, time.time())}
        if stage == "weights_loaded":
            line["weights_bytes"] = self.weights_bytes
        log.info("%s", json.dumps(line))

    # --- engine task --------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        sched = self.sched
        deadline = time.monotonic()
        while True:
            if not sched.has_work:
                self._wake.clear()
                await self._wake.wait()
                deadline = time.monotonic()
            step = None
            try:
                step = sched.schedule()
                if step is None:  # waiting but nothing admissible and nothing running
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                dt = step.duration * self.time_scale
                if dt > 0:
                    now = time.monotonic()
                    # Catch up at most one step of timer lateness; never run ahead.
                    deadline = max(deadline, now - dt) + dt
                    if deadline > now:
                        await asyncio.sleep(deadline - now)
                else:
                    await asyncio.sleep(0)
                now = time.monotonic()
                for out in sched.complete(step, now):
                    self._deliver(out, now)
                if self._kv_pub is not None:
                    self._publish_kv()
            except Exception:
                ids = (
                    [seq.req_id for seq, _ in step.scheduled]
                    if step is not None
                    else list(self._sinks)
                )
                log.exception(
                    "engine step failed; failing its %d request(s) and going on", len(ids)
                )
                for req_id in ids:
                    self._fail(req_id, "the engine step failed unexpectedly; retry the request")
                await asyncio.sleep(0)

    def _publish_kv(self) -> None:
        """Send the prefix cache's changes since the last call as one vLLM EventBatch."""
        kv = self.sched.kv
        raw = kv.events
        if self._kv_pub is None or not raw:
            return
        kv.events = []

        def tokens_of(seq: Hashable) -> list[int] | None:
            known = self._kv_tokens.get(seq)
            if known is None:
                return None
            prompt, max_tokens, _ = known
            return prompt + Tokenizer.filler_ids(0, max_tokens)

        def salt_of(seq: Hashable) -> str | None:
            known = self._kv_tokens.get(seq)
            return known[2] if known is not None else None

        self._kv_pub.publish(batch_events(raw, tokens_of, kv.block_size, self._kv_ext, salt_of))
        for req_id in [r for r in self._kv_tokens if r not in self._sinks]:
            del self._kv_tokens[req_id]

    def _fail(self, req_id: Hashable, message: str) -> None:
        """Abort a request and answer it with a server error (500 or an SSE error event)."""
        sink = self._sinks.pop(req_id, None)
        with contextlib.suppress(Exception):
            self.sched.abort(req_id)
        if sink is None:
            return
        self.metrics.finished("abort")
        if sink.stream:
            assert sink.queue is not None
            sink.queue.put_nowait(None)
        elif sink.done is not None and not sink.done.done():
            sink.done.set_exception(_BadRequest(500, message))

    def _deliver(self, out: SeqOutput, now: float) -> None:
        sink = self._sinks.get(out.req_id)
        if sink is None:
            return
        if out.first:
            self.metrics.ttft.observe(now - sink.arrival)
        if out.finished:
            self.metrics.e2e.observe(now - sink.arrival)
            self.metrics.finished(out.finish_reason or "length")
            del self._sinks[out.req_id]
        if sink.stream:
            assert sink.queue is not None
            sink.queue.put_nowait(out)
        elif out.finished:
            assert sink.done is not None
            if not sink.done.done():
                sink.done.set_result(out)

    def _submit(
        self, tokens: list[int], max_tokens: int, stream: bool, salt: str | None, param: str
    ) -> tuple[str, _Sink]:
        req_id = f"{next(self._ids):x}"
        loop = asyncio.get_running_loop()
        sink = _Sink(stream=stream, arrival=time.monotonic())
        if stream:
            sink.queue = asyncio.Queue()
        else:
            sink.done = loop.create_future()
        try:
            self.sched.add_request(req_id, tokens, max_tokens, sink.arrival, salt=salt)
        except PromptTooLong as exc:
            raise _BadRequest(400, str(exc), param) from exc
        self._sinks[req_id] = sink
        if self._kv_pub is not None:
            self._kv_tokens[req_id] = (tokens, max_tokens, salt)
        self._wake.set()
        return req_id, sink

    def _abort(self, req_id: str) -> None:
        if self._sinks.pop(req_id, None) is not None:
            self.sched.abort(req_id)
            self.metrics.finished("abort")

    # --- HTTP ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except _BadRequest as exc:
            return _error(exc.status, exc.message, exc.param)
        except web.HTTPNotFound:
            return _error(404, f"no route {request.method} {request.path}")
        except web.HTTPMethodNotAllowed:
            return _error(405, f"method {request.method} not allowed on {request.path}")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _BadRequest(
                413,
                f"request body exceeds the limit of {self.config.max_body_bytes} bytes; "
                "send a shorter prompt",
            ) from exc
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadRequest(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _BadRequest(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _BadRequest(400, "'model' must be a string", "model")
        if model is not None and model != self.model:
            raise _BadRequest(
                404,
                f"The model `{model}` does not exist. This engine serves `{self.model}`.",
                "model",
            )
        if not self.ready:
            raise _BadRequest(
                503, "the engine is still loading its weights; retry when /health is 200"
            )
        return body

    def _params(self, body: dict[str, Any], default_max: int) -> tuple[int, bool, bool, str | None]:
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = default_max
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _BadRequest(
                400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens"
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _BadRequest(400, "'stream' must be true or false", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise _BadRequest(400, "'stream_options' must be an object", "stream_options")
        n = body.get("n", 1)
        if n != 1:
            raise _BadRequest(400, f"'n' must be 1 (got {n!r}); send separate requests", "n")
        for name in ("temperature", "top_p"):
            v = body.get(name)
            if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
                raise _BadRequest(400, f"'{name}' must be a number", name)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise _BadRequest(400, "'cache_salt' must be a string", "cache_salt")
        return max_tokens, stream, bool(opts.get("include_usage", False)), salt

    def _prompt_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return self.tokenizer.encode(prompt[0])
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            return list(prompt)
        if prompt is None:
            raise _BadRequest(400, "'prompt' is required", "prompt")
        raise _BadRequest(
            400, "'prompt' must be a string or a non-empty list of token ids (one prompt)", "prompt"
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        tokens = self._prompt_tokens(body.get("prompt"))
        max_tokens, stream, include_usage, salt = self._params(body, DEFAULT_COMPLETION_MAX_TOKENS)
        return await self._generate(
            request, tokens, max_tokens, stream, include_usage, salt, chat=False
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if "messages" not in body:
            raise _BadRequest(400, "'messages' is required", "messages")
        try:
            text = render_chat(body["messages"], body.get("tools"))
        except ConfigError as exc:
            param = str(exc).split(" ", 1)[0]
            raise _BadRequest(
                400, str(exc), param if param.startswith(("messages", "tools")) else "messages"
            ) from exc
        tokens = self.tokenizer.encode(text)
        max_tokens, stream, include_usage, salt = self._params(body, DEFAULT_CHAT_MAX_TOKENS)
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
                        "usage": _usage(out),
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
                    _sse(
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
                await resp.write(_sse(head, [c]))
                if out.finished:
                    finished = True
                    if include_usage:
                        await resp.write(_sse(head, [], usage=_usage(out)))
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
            return _error(503, "Loading model")
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


def _usage(out: SeqOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def _sse(head: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
    tail = f'"choices":{json.dumps(choices)}'
    if usage is not None:
        tail += f',"usage":{json.dumps(usage)}'
    return f"data: {head}{tail}}}\n\n".encode()


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
