"""The router's proxy handlers: forward OpenAI requests to the instance a policy chose.

Request life: read the body (over ``max_body_bytes`` -> 413), parse JSON (malformed ->
400 in OpenAI error format), pick the variant (``X-Preheat-Variant`` header, else by
weight), let the variant's policy choose among its healthy, non-draining instances
(none -> 503 with ``Retry-After``), count it in flight, forward. An instance that
refuses the connection is marked unhealthy and the request is tried once more on
another; one that sends nothing for ``upstream_timeout_s`` -> 504; one that dies
mid-stream ends the client's stream with an ``error`` event and is marked unhealthy.
Each response carries ``X-Preheat-Instance`` and ``X-Preheat-Outcome`` headers.

Hot path (benchmarks/router_overhead.py): the body is read once and parsed with orjson;
plain-HTTP instances are reached through the lean keep-alive client of ``upstream.py``
(one write per request, no per-request timeout objects; https instances go through
aiohttp); a non-streaming answer is read whole and returned as one ``web.Response``;
counters are plain ints read at scrape time (``metrics.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from preheat.errors import ConfigError, NoHealthyInstance
from preheat.router.policies import Choice, RouteRequest
from preheat.router.state import VARIANT_HEADER, RoutingState, Upstream, VariantRuntime
from preheat.router.upstream import (
    BadResponse,
    ConnectFailed,
    Disconnected,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from preheat.telemetry.routing import DecisionLog, RouteDecision

log = logging.getLogger("preheat.router")

HINT_HEADER = "X-Preheat-Prefix-Id"
_HOP = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "accept-encoding",
    "expect",
}


def openai_error(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An error response in the OpenAI format: {"error": {"message", "type", "code"}}."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Proxy:
    """The ``/v1/*`` handlers over a routing state; ``pool`` and ``session`` are set when
    the router starts (they need a running event loop)."""

    def __init__(self, state: RoutingState, decision_log: DecisionLog | None = None) -> None:
        self.state = state
        self.decision_log = decision_log
        self.pool: UpstreamPool | None = None
        self._session: aiohttp.ClientSession | None = None
        self._log_failed = False
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

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        metrics = state.metrics
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            metrics.child(metrics.rejected, "413").inc()
            return openai_error(
                413,
                f"request body is over the router's limit of {state.config.max_body_bytes} bytes",
                "invalid_request_error",
            )
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            metrics.child(metrics.rejected, "400").inc()
            return openai_error(
                400, f"request body is not valid JSON: {exc}", "invalid_request_error"
            )
        if not isinstance(body, dict):
            metrics.child(metrics.rejected, "400").inc()
            return openai_error(400, "request body must be a JSON object", "invalid_request_error")
        try:
            rt = state.variant_for(request.headers.get(VARIANT_HEADER))
        except ConfigError as exc:
            return openai_error(400, str(exc), "invalid_request_error")
        request_id = request.headers.get("X-Request-Id") or os.urandom(16).hex()
        rreq = RouteRequest(request_id=request_id, body=body, hint=request.headers.get(HINT_HEADER))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Request-Id"] = request_id
        tried: set[str] = set()
        for _attempt in range(2):
            candidates = rt.live if not tried else [u for u in rt.live if u.id not in tried]
            t0 = time.perf_counter_ns()
            try:
                choice = rt.policy.choose(rreq, candidates)
            except NoHealthyInstance:
                metrics.child(metrics.rejected, "503").inc()
                return openai_error(
                    503,
                    f"variant {rt.config.name!r} has no healthy instance; retry shortly",
                    "service_unavailable",
                    headers={"Retry-After": "1"},
                )
            except ConfigError as exc:
                return openai_error(400, str(exc), "invalid_request_error")
            decision_us = (time.perf_counter_ns() - t0) / 1000.0
            up = choice.instance
            result = await self._forward(request, rt, rreq, choice, raw, headers, decision_us)
            if result is not None:
                return result
            tried.add(up.id)
        return openai_error(
            502, "no instance accepted the connection", "upstream_error", {"Retry-After": "1"}
        )

    async def _forward(
        self,
        request: web.Request,
        rt: VariantRuntime,
        rreq: RouteRequest,
        choice: Choice[Upstream],
        raw: bytes,
        headers: dict[str, str],
        decision_us: float,
    ) -> web.StreamResponse | None:
        """Send to the chosen instance; None means 'never connected, try another'."""
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
                resp = await self._send(up.id, request.path, raw, headers)
            except (ConnectFailed, Disconnected) as exc:
                # Refused, or hung up before answering on a fresh connection too.
                m.child(m.upstream_errors, vname, up.id, "connect").inc()
                log.warning("instance %s refused the request: %s", up.id, exc)
                state.set_state(up, "unhealthy")
                return None
            except TimeoutError:
                m.child(m.upstream_errors, vname, up.id, "timeout").inc()
                return openai_error(
                    504,
                    f"instance did not answer within {state.config.upstream_timeout_s} s",
                    "upstream_timeout",
                    extra,
                )
            except UpstreamError as exc:
                m.child(m.upstream_errors, vname, up.id, "connect").inc()
                state.set_state(up, "unhealthy")
                return openai_error(502, f"upstream error: {exc}", "upstream_error", extra)
            async with resp:
                if resp.status >= 500:
                    m.child(m.upstream_errors, vname, up.id, "status").inc()
                ctype = resp.headers.get("content-type", "application/json")
                if ctype.startswith("text/event-stream"):
                    out, usage, ok = await self._stream(
                        request, resp, ctype, extra, sampled, up, rt
                    )
                    return out
                try:
                    data = await resp.read()
                except TimeoutError:
                    m.child(m.upstream_errors, vname, up.id, "timeout").inc()
                    return openai_error(
                        504,
                        f"instance did not finish within {state.config.upstream_timeout_s} s",
                        "upstream_timeout",
                        extra,
                    )
                except UpstreamError as exc:
                    m.child(m.upstream_errors, vname, up.id, "stream").inc()
                    state.set_state(up, "unhealthy")
                    return openai_error(
                        502, f"instance failed mid-response: {exc}", "upstream_error", extra
                    )
                ok = resp.status < 400
                if sampled and ok:
                    usage = _usage_of(data)
                return web.Response(
                    body=data, status=resp.status, headers={**extra, "Content-Type": ctype}
                )
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
        self, origin: str, path: str, raw: bytes, headers: dict[str, str]
    ) -> UpstreamResponse | _AiohttpResponse:
        """POST the body to an instance: plain-HTTP instances through the lean keep-alive
        pool (``upstream.py``), https ones through aiohttp.

        Both retry once on a fresh connection if a pooled keep-alive one was stale: an
        instance may close an idle connection just as we reuse it (seen with
        llama-server; uvicorn closes idle ones after 5 s), which is not the instance
        failing. A refused connection is not retried here.
        """
        pool = self.pool
        if pool is not None and origin.startswith("http://"):
            return await pool.post(origin, path, raw, headers)
        url = origin + path
        try:
            try:
                return _AiohttpResponse(
                    await self.session.post(
                        url, data=raw, headers=headers, timeout=self.client_timeout
                    )
                )
            except TimeoutError:
                raise
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                log.debug("retrying %s on a fresh connection after %r", url, exc)
                return _AiohttpResponse(
                    await self.session.post(
                        url, data=raw, headers=headers, timeout=self.client_timeout
                    )
                )
        except TimeoutError:
            raise
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(str(exc)) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise Disconnected(str(exc), reused=False, started=False) from exc
        except aiohttp.ClientError as exc:
            raise BadResponse(str(exc)) from exc

    async def _stream(
        self,
        request: web.Request,
        resp: UpstreamResponse | _AiohttpResponse,
        ctype: str,
        extra: dict[str, str],
        sampled: bool,
        up: Upstream,
        rt: VariantRuntime,
    ) -> tuple[web.StreamResponse, dict[str, Any] | None, bool]:
        out = web.StreamResponse(
            status=resp.status,
            headers={**extra, "Content-Type": ctype, "Cache-Control": "no-cache"},
        )
        await out.prepare(request)
        tail = b""
        ok = resp.status < 400
        try:
            async for chunk in resp.iter_any():
                try:
                    await out.write(chunk)
                except ConnectionError:
                    # The client went away: stop reading; leaving the block closes the
                    # upstream response, which aborts the generation on the engine.
                    return out, None, False
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
            await out.write_eof()
        usage = _sse_usage(tail) if sampled and ok else None
        return out, usage, ok

    async def models(self, request: web.Request) -> web.StreamResponse:
        for rt in self.state.variants.values():
            for up in rt.live:
                try:
                    async with self.session.get(
                        up.id + "/v1/models", timeout=self.client_timeout
                    ) as resp:
                        data = await resp.read()
                        ctype = resp.headers.get("Content-Type", "application/json")
                        return web.Response(
                            body=data, status=resp.status, headers={"Content-Type": ctype}
                        )
                except (aiohttp.ClientError, TimeoutError):
                    continue
        return openai_error(
            503, "no healthy instance to list models", "service_unavailable", {"Retry-After": "1"}
        )


class _AiohttpResponse:
    """An aiohttp response behind ``UpstreamResponse``'s interface (https instances)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.headers.items()}

    async def __aenter__(self) -> _AiohttpResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.resp.release()

    async def read(self) -> bytes:
        try:
            return await self.resp.read()
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise Disconnected(str(exc), reused=False, started=True) from exc

    async def iter_any(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.content.iter_any():
                yield chunk
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise Disconnected(str(exc), reused=False, started=True) from exc


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
