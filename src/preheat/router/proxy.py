"""The router's proxy: forward OpenAI requests to the instance a policy chose.

Request life: parse the body as JSON (malformed -> 400 in OpenAI error format; a body
over ``max_body_bytes`` is refused with 413 by the HTTP server before it gets here),
pick the variant (``X-Preheat-Variant`` header, else by weight), let the variant's
policy choose among its healthy, non-draining instances (none -> 503 with
``Retry-After``), count it in flight, forward. An instance that refuses the connection
is marked unhealthy and the request is tried once more on another; one that sends
nothing for ``upstream_timeout_s`` -> 504; one that dies mid-stream ends the client's
stream with an ``error`` event and is marked unhealthy. Each response carries the
instance's own headers (repeats kept; hop-by-hop and framing ones left out:
``wire.passed_headers``) and ``X-Preheat-Instance`` and ``X-Preheat-Outcome``.

The logic does not know the HTTP server: a server turns a request into an ``Incoming``
and gives ``Proxy.handle`` a ``Sink`` to answer through. Two servers do: the raw-protocol
front of ``front.py`` (what ``preheat router serve`` listens with) and aiohttp
(``proxy_web.py``: ``Proxy.proxy`` is its handler, used with ``--front aiohttp``, for
requests the front hands over, and in tests that mount ``build_app``).

Hot path (benchmarks/router_overhead.py): the body is parsed once with orjson; the
forwarded headers arrive as one pre-encoded block; plain-HTTP instances are reached
through the lean keep-alive client of ``upstream.py`` (one write per request, no
per-request timeout objects; https instances go through aiohttp); a non-streaming
answer is read whole and answered in one write; counters are plain ints read at scrape
time (``metrics.py``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from preheat.errors import ConfigError, NoHealthyInstance
from preheat.router.policies import Choice, RouteRequest
from preheat.router.proxy_web import (
    AiohttpResponse,
    WebSink,
    https_post,
    incoming_of,
    multidict_of,
)
from preheat.router.state import RoutingState, Upstream, VariantRuntime
from preheat.router.upstream import UpstreamPool
from preheat.router.upstream_errors import ConnectFailed, Disconnected, UpstreamError
from preheat.router.upstream_response import UpstreamResponse
from preheat.router.wire import (
    ERROR_CTYPE,
    HINT_HEADER,
    Incoming,
    Sink,
    error_body,
    passed_headers,
    reply_error,
    too_large_message,
)
from preheat.telemetry.routing import DecisionLog, RouteDecision

__all__ = ["HINT_HEADER", "Incoming", "Proxy", "Sink", "openai_error"]

log = logging.getLogger("preheat.router")

#: Request ids only need to be unique: a seeded PRNG, not a syscall per request.
_ids = random.Random()
JSON = "application/json"


def openai_error(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> web.Response:
    """``error_body`` as an aiohttp response."""
    return web.Response(
        body=error_body(status, message, kind),
        status=status,
        headers={**(headers or {}), "Content-Type": ERROR_CTYPE},
    )


class Proxy:
    """The ``/v1/*`` handlers over a routing state; ``pool`` and ``session`` are set when
    the router starts (they need a running event loop)."""

    def __init__(self, state: RoutingState, decision_log: DecisionLog | None = None) -> None:
        self.state = state
        self.decision_log = decision_log
        self.pool: UpstreamPool | None = None
        self._session: aiohttp.ClientSession | None = None
        self._log_failed = False
        self.client_timeout: Any = None
        self.set_timeouts()

    def set_timeouts(self) -> None:
        """Take the config's connect and read timeouts (called on every config change, so
        ``PUT /admin/config`` applies them to the next request)."""
        cfg = self.state.config
        self.client_timeout = aiohttp.ClientTimeout(
            total=None, connect=cfg.connect_timeout_s, sock_read=cfg.upstream_timeout_s
        )
        if self.pool is not None:
            self.pool.connect_timeout = cfg.connect_timeout_s
            self.pool.read_timeout = cfg.upstream_timeout_s

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started")
        return self._session

    @session.setter
    def session(self, session: aiohttp.ClientSession | None) -> None:
        self._session = session

    # --- the aiohttp handlers -----------------------------------------------------------

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` and ``/v1/chat/completions`` under aiohttp."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.count_rejected(413)
            limit = self.state.config.max_body_bytes
            return openai_error(413, too_large_message(limit), "invalid_request_error")
        sink = WebSink(request)
        await self.handle(incoming_of(request, raw), sink)
        return sink.response

    async def models(self, request: web.Request) -> web.StreamResponse:
        for rt in self.state.variants.values():
            for up in rt.live:
                try:
                    async with self.session.get(
                        up.id + "/v1/models", timeout=self.client_timeout
                    ) as resp:
                        data = await resp.read()
                        passed = passed_headers(resp.headers.items())
                        mine = {} if "Content-Type" in resp.headers else {"Content-Type": JSON}
                        return web.Response(
                            body=data, status=resp.status, headers=multidict_of(passed, mine)
                        )
                except (aiohttp.ClientError, TimeoutError):
                    continue
        return openai_error(
            503, "no healthy instance to list models", "service_unavailable", {"Retry-After": "1"}
        )

    # --- the proxy ------------------------------------------------------------------------

    def count_rejected(self, status: int) -> None:
        m = self.state.metrics
        m.child(m.rejected, str(status)).inc()

    async def handle(self, inc: Incoming, out: Sink) -> None:
        """Answer one proxied request through ``out``."""
        state = self.state
        try:
            body = orjson.loads(inc.raw)
        except orjson.JSONDecodeError as exc:
            self.count_rejected(400)
            msg = f"request body is not valid JSON: {exc}"
            return reply_error(out, 400, msg, "invalid_request_error")
        if not isinstance(body, dict):
            self.count_rejected(400)
            msg = "request body must be a JSON object"
            return reply_error(out, 400, msg, "invalid_request_error")
        try:
            rt = state.variant_for(inc.variant)
        except ConfigError as exc:
            return reply_error(out, 400, str(exc), "invalid_request_error")
        request_id = inc.request_id or f"{_ids.getrandbits(128):032x}"
        rreq = RouteRequest(request_id=request_id, body=body, hint=inc.hint)
        headers = inc.headers + b"\r\nX-Request-Id: " + request_id.encode("latin-1", "replace")
        tried: set[str] = set()
        for _attempt in range(2):
            candidates = rt.live if not tried else [u for u in rt.live if u.id not in tried]
            t0 = time.perf_counter_ns()
            try:
                choice = rt.policy.choose(rreq, candidates)
            except NoHealthyInstance:
                self.count_rejected(503)
                return reply_error(
                    out,
                    503,
                    f"variant {rt.config.name!r} has no healthy instance; retry shortly",
                    "service_unavailable",
                    {"Retry-After": "1"},
                )
            except ConfigError as exc:
                return reply_error(out, 400, str(exc), "invalid_request_error")
            decision_us = (time.perf_counter_ns() - t0) / 1000.0
            if await self._forward(out, inc, rt, rreq, choice, headers, decision_us):
                return None
            tried.add(choice.instance.id)
        return reply_error(
            out, 502, "no instance accepted the connection", "upstream_error", {"Retry-After": "1"}
        )

    async def _forward(
        self,
        out: Sink,
        inc: Incoming,
        rt: VariantRuntime,
        rreq: RouteRequest,
        choice: Choice[Upstream],
        headers: bytes,
        decision_us: float,
    ) -> bool:
        """Send to the chosen instance and answer; False means 'never connected, try
        another' (nothing was answered)."""
        up = choice.instance
        state = self.state
        m = state.metrics
        vname = rt.config.name
        strategy = rt.config.strategy
        m.observe(vname, strategy, choice.outcome, up.id, decision_us)
        sampled = self.decision_log is not None and self.decision_log.sampled()
        usage: dict[str, Any] | None = None
        ok = False
        up.in_flight += 1
        rt.policy.on_sent(rreq, choice)
        extra = {"X-Preheat-Instance": up.id, "X-Preheat-Outcome": choice.outcome}
        try:
            try:
                resp = await self._send(up.id, inc.path, inc.raw, headers)
            except (ConnectFailed, Disconnected) as exc:
                # Refused, or hung up before answering on a fresh connection too.
                m.child(m.upstream_errors, vname, up.id, "connect").inc()
                log.warning("instance %s refused the request: %s", up.id, exc)
                state.set_state(up, "unhealthy")
                return False
            except TimeoutError:
                m.child(m.upstream_errors, vname, up.id, "timeout").inc()
                limit = state.config.upstream_timeout_s
                msg = f"instance did not answer within {limit} s"
                reply_error(out, 504, msg, "upstream_timeout", extra)
                return True
            except UpstreamError as exc:
                m.child(m.upstream_errors, vname, up.id, "connect").inc()
                state.set_state(up, "unhealthy")
                reply_error(out, 502, f"upstream error: {exc}", "upstream_error", extra)
                return True
            async with resp:
                if resp.status >= 500:
                    m.child(m.upstream_errors, vname, up.id, "status").inc()
                ctype = resp.headers.get("content-type", "application/json")
                if ctype.startswith("text/event-stream"):
                    usage, ok = await self._stream(out, resp, ctype, extra, sampled, up, rt)
                    return True
                try:
                    data = await resp.read()
                except TimeoutError:
                    m.child(m.upstream_errors, vname, up.id, "timeout").inc()
                    limit = state.config.upstream_timeout_s
                    msg = f"instance did not finish within {limit} s"
                    reply_error(out, 504, msg, "upstream_timeout", extra)
                    return True
                except UpstreamError as exc:
                    m.child(m.upstream_errors, vname, up.id, "stream").inc()
                    state.set_state(up, "unhealthy")
                    msg = f"instance failed mid-response: {exc}"
                    reply_error(out, 502, msg, "upstream_error", extra)
                    return True
                ok = resp.status < 400
                if sampled and ok:
                    usage = _usage_of(data)
                if "content-type" not in resp.headers:
                    extra["Content-Type"] = ctype
                out.reply(resp.status, extra, data, resp.passed)
                return True
        finally:
            up.in_flight -= 1
            cached = _cached_tokens(usage)
            rt.policy.on_done(rreq, choice, ok=ok, cached_tokens=cached)
            if sampled and self.decision_log is not None:
                self._record(
                    RouteDecision(
                        ts=time.time(),
                        request_id=rreq.request_id,
                        variant=vname,
                        strategy=strategy,
                        instance=up.id,
                        rank=choice.rank,
                        outcome=choice.outcome,
                        matched_blocks=choice.matched_blocks,
                        prefix_blocks=choice.prefix_blocks,
                        predicted_cached_tokens=choice.predicted_cached_tokens,
                        actual_cached_tokens=cached,
                        prompt_tokens=_int(usage.get("prompt_tokens")) if usage else None,
                        decision_us=round(decision_us, 2),
                    )
                )

    def _record(self, decision: RouteDecision) -> None:
        """Append a decision; a failed write (disk full, I/O error) drops the record, counts
        it and warns once: telemetry never fails a request that was answered."""
        assert self.decision_log is not None
        try:
            self.decision_log.write(decision)
        except Exception as exc:  # any failure of the log, never the request
            m = self.state.metrics
            m.decision_log_dropped.inc()
            if not self._log_failed:
                self._log_failed = True
                reason = exc.strerror if isinstance(exc, OSError) else None
                log.warning(
                    "decision log %s: a write failed (%s); requests go on, dropped records "
                    "are counted in preheat_router_decision_log_dropped_total (warned once)",
                    self.decision_log.path,
                    reason or type(exc).__name__,
                )

    async def _send(
        self, origin: str, path: str, raw: bytes, headers: bytes
    ) -> UpstreamResponse | AiohttpResponse:
        """POST the body to an instance: plain-HTTP instances through the lean keep-alive
        pool (``upstream.py``), https ones through aiohttp (``proxy_web.https_post``).
        Both retry once on a fresh connection if a pooled keep-alive one was stale."""
        pool = self.pool
        if pool is not None and origin.startswith("http://"):
            return await pool.post(origin, path, raw, headers)
        return await https_post(self.session, origin + path, raw, headers, self.client_timeout)

    async def _stream(
        self,
        out: Sink,
        resp: UpstreamResponse | AiohttpResponse,
        ctype: str,
        extra: dict[str, str],
        sampled: bool,
        up: Upstream,
        rt: VariantRuntime,
    ) -> tuple[dict[str, Any] | None, bool]:
        """Pass an SSE answer through piece by piece as it arrives."""
        if "cache-control" not in resp.headers:
            extra["Cache-Control"] = "no-cache"
        await out.start(resp.status, extra, resp.passed)
        tail = b""
        ok = resp.status < 400
        try:
            async for chunk in resp.iter_any():
                try:
                    await out.write(chunk)
                except ConnectionError:
                    # The client went away: stop reading; leaving the block closes the
                    # upstream response, which aborts the generation on the engine.
                    return None, False
                if sampled:
                    tail = (tail + chunk)[-8192:]
        except (UpstreamError, TimeoutError) as exc:
            kind = "timeout" if isinstance(exc, TimeoutError) else "stream"
            m = self.state.metrics
            m.child(m.upstream_errors, rt.config.name, up.id, kind).inc()
            log.warning("instance %s failed mid-stream: %r", up.id, exc)
            if kind == "stream":
                self.state.set_state(up, "unhealthy")
            err = {
                "error": {
                    "message": f"the instance failed mid-stream ({kind}); the answer is incomplete",
                    "type": "upstream_error",
                    "code": 502 if kind == "stream" else 504,
                }
            }
            with contextlib.suppress(ConnectionError, RuntimeError):
                await out.write(b"event: error\ndata: " + orjson.dumps(err) + b"\n\n")
            ok = False
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.end()
        usage = _sse_usage(tail) if sampled and ok else None
        return usage, ok


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _usage_of(data: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


def _sse_usage(tail: bytes) -> dict[str, Any] | None:
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            usage = _usage_of(line[5:].strip())
            if usage:
                return usage
    return None


def _cached_tokens(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        return _int(details.get("cached_tokens"))
    return None
