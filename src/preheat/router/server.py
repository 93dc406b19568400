"""The router's HTTP proxy (aiohttp on uvloop).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (bodies forwarded
unchanged; SSE streams passed through chunk by chunk as they arrive), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` and the token-protected ``/admin`` API (``admin.py``).

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
counters are plain ints read at scrape time (``metrics.py``); no access log; uvloop;
the start-up heap is frozen out of the cyclic GC.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from preheat.errors import ConfigError, NoHealthyInstance
from preheat.router.config import RouterConfig, VariantConfig
from preheat.router.metrics import RouterMetrics
from preheat.router.policies import Choice, Policy, RouteRequest, make_policy
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
VARIANT_HEADER = "X-Preheat-Variant"
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
STATES = ("healthy", "unhealthy", "draining")


@dataclass(eq=False, slots=True)
class Upstream:
    """One instance as the router sees it: URL (its id), state and in-flight count."""

    id: str
    variant: str
    in_flight: int = 0
    state: str = "healthy"
    failures: int = 0


@dataclass(eq=False)
class VariantRuntime:
    """A variant's config, policy and instances; ``live`` are those that take traffic."""

    config: VariantConfig
    policy: Policy[Upstream]
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    live: list[Upstream] = field(default_factory=list)

    def refresh(self) -> None:
        self.live = [u for u in self.upstreams.values() if u.state == "healthy"]


def openai_error(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An error response in the OpenAI format: {"error": {"message", "type", "code"}}."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Router:
    """The live router: config, per-variant policies and instances, metrics, decision log."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        salt: bytes,
        admin_token: str | None = None,
        decision_log: DecisionLog | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.salt = salt
        self.admin_token = admin_token
        self.decision_log = decision_log
        self.rng = rng or random.Random()
        self.metrics = RouterMetrics(in_flight_source=self._in_flight)
        self.variants: dict[str, VariantRuntime] = {}
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._pool: UpstreamPool | None = None
        self._apply(config)

    # --- configuration --------------------------------------------------------------------

    def _apply(self, config: RouterConfig) -> None:
        """Switch to ``config`` (already validated), keeping instances and policies that stay."""
        new: dict[str, VariantRuntime] = {}
        for vc in config.variants:
            old = self.variants.get(vc.name)
            policy = None
            if old is not None:
                op = old.config.params
                np_ = vc.params
                same_shape = (
                    old.config.strategy == vc.strategy
                    and op.prefix_length == np_.prefix_length
                    and op.block_chars == np_.block_chars
                    and op.index_entries == np_.index_entries
                    and op.max_holders == np_.max_holders
                )
                if same_shape:
                    policy = old.policy
                    # Threshold and epsilon are read per decision: change them in place
                    # and keep the learned index.
                    policy.params = np_  # type: ignore[attr-defined]
            if policy is None:
                policy = make_policy(vc.strategy, vc.params, salt=self.salt, rng=self.rng)
            rt = VariantRuntime(config=vc, policy=policy)
            for url in vc.instances:
                up = old.upstreams.get(url) if old is not None else None
                rt.upstreams[url] = up if up is not None else Upstream(id=url, variant=vc.name)
            if old is not None:
                for url in old.upstreams:
                    if url not in rt.upstreams:
                        if policy is old.policy:
                            policy.forget(url)
                        self.metrics.forget(vc.name, url)
            rt.refresh()
            new[vc.name] = rt
        for name, old in self.variants.items():
            if name not in new:
                for url in old.upstreams:
                    self.metrics.forget(name, url)
        self.variants = new
        self.config = config
        for rt in new.values():
            for u in rt.upstreams.values():
                self._export_health(u)

    def replace_config(self, config: RouterConfig) -> None:
        """Apply a validated config; instances that stay keep their state and counters."""
        self._apply(config)

    def set_state(self, up: Upstream, state: str) -> None:
        if state not in STATES:
            raise ConfigError(f"instance state {state!r} is not one of {STATES}")
        if up.state != state:
            log.info("instance %s: %s -> %s", up.id, up.state, state)
            up.state = state
            rt = self.variants.get(up.variant)
            if rt is not None and rt.upstreams.get(up.id) is up:
                rt.refresh()
            self._export_health(up)

    def _export_health(self, up: Upstream) -> None:
        self.metrics.child(self.metrics.healthy, up.variant, up.id).set(
            1 if up.state == "healthy" else 0
        )

    def _in_flight(self) -> list[tuple[str, str, int]]:
        return [
            (name, u.id, u.in_flight)
            for name, rt in self.variants.items()
            for u in rt.upstreams.values()
        ]

    def find(self, url: str) -> Upstream | None:
        for rt in self.variants.values():
            up = rt.upstreams.get(url)
            if up is not None:
                return up
        return None

    def snapshot(self) -> dict[str, Any]:
        """The whole config as JSON, with each instance's state and in-flight count."""
        out = self.config.to_dict()
        for v in out["variants"]:
            rt = self.variants[v["name"]]
            v["instances"] = [
                {"url": u.id, "state": u.state, "in_flight": u.in_flight}
                for u in rt.upstreams.values()
            ]
        return out

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=None, connect=cfg.connect_timeout_s, sock_read=cfg.upstream_timeout_s
        )
        # One session for the router's life: an unbounded keep-alive pool (the policies
        # bound the load per instance), no cookie jar (a proxy must not carry cookies
        # between clients), bodies passed through compressed or not as they came.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._pool = UpstreamPool(
            connect_timeout=cfg.connect_timeout_s, read_timeout=cfg.upstream_timeout_s
        )
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health")

    async def stop(self, app: web.Application) -> None:
        task = getattr(self, "_health_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pool is not None:
            await self._pool.close()
        if self._session is not None:
            await self._session.close()
        if self.decision_log is not None:
            self.decision_log.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started")
        return self._session

    async def _check(self, up: Upstream) -> None:
        h = self.config.health
        try:
            async with self.session.get(
                up.id + h.path, timeout=aiohttp.ClientTimeout(total=h.timeout_s)
            ) as resp:
                await resp.read()
                ok = resp.status < 500
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            up.failures = 0
            if up.state == "unhealthy":
                self.set_state(up, "healthy")
        else:
            up.failures += 1
            if up.state == "healthy" and up.failures >= h.failures:
                self.set_state(up, "unhealthy")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health.interval_s)
            ups = [u for rt in self.variants.values() for u in rt.upstreams.values()]
            await asyncio.gather(*(self._check(u) for u in ups))

    # --- proxy ----------------------------------------------------------------------------

    def _variant_for(self, request: web.Request) -> VariantRuntime:
        name = request.headers.get(VARIANT_HEADER)
        if name is not None:
            rt = self.variants.get(name)
            if rt is None:
                raise ConfigError(
                    f"{VARIANT_HEADER} {name!r} is unknown; known: {', '.join(self.variants)}"
                )
            return rt
        rts = list(self.variants.values())
        if len(rts) == 1:
            return rts[0]
        weights = [rt.config.weight if rt.live else 0.0 for rt in rts]
        if sum(weights) <= 0:
            weights = [rt.config.weight for rt in rts]
        if sum(weights) <= 0:
            return rts[0]
        return self.rng.choices(rts, weights=weights)[0]

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.child(self.metrics.rejected, "413").inc()
            return openai_error(
                413,
                f"request body is over the router's limit of {self.config.max_body_bytes} bytes",
                "invalid_request_error",
            )
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self.metrics.child(self.metrics.rejected, "400").inc()
            return openai_error(
                400, f"request body is not valid JSON: {exc}", "invalid_request_error"
            )
        if not isinstance(body, dict):
            self.metrics.child(self.metrics.rejected, "400").inc()
            return openai_error(400, "request body must be a JSON object", "invalid_request_error")
        try:
            rt = self._variant_for(request)
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
                self.metrics.child(self.metrics.rejected, "503").inc()
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
        m = self.metrics
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
                self.set_state(up, "unhealthy")
                return None
            except TimeoutError:
                m.child(m.upstream_errors, vname, up.id, "timeout").inc()
                return openai_error(
                    504,
                    f"instance did not answer within {self.config.upstream_timeout_s} s",
                    "upstream_timeout",
                    extra,
                )
            except UpstreamError as exc:
                m.child(m.upstream_errors, vname, up.id, "connect").inc()
                self.set_state(up, "unhealthy")
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
                        f"instance did not finish within {self.config.upstream_timeout_s} s",
                        "upstream_timeout",
                        extra,
                    )
                except UpstreamError as exc:
                    m.child(m.upstream_errors, vname, up.id, "stream").inc()
                    self.set_state(up, "unhealthy")
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
                self.decision_log.write(
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
        pool = self._pool
        if pool is not None and origin.startswith("http://"):
            return await pool.post(origin, path, raw, headers)
        url = origin + path
        try:
            try:
                return _AiohttpResponse(await self.session.post(url, data=raw, headers=headers))
            except TimeoutError:
                raise
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                log.debug("retrying %s on a fresh connection after %r", url, exc)
                return _AiohttpResponse(await self.session.post(url, data=raw, headers=headers))
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
            self.metrics.child(self.metrics.upstream_errors, rt.config.name, up.id, kind).inc()
            log.warning("instance %s failed mid-stream: %r", up.id, exc)
            if kind == "stream":
                self.set_state(up, "unhealthy")
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
        for rt in self.variants.values():
            for up in rt.live:
                try:
                    async with self.session.get(up.id + "/v1/models") as resp:
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

    async def health(self, request: web.Request) -> web.Response:
        variants = {
            name: {"healthy": len(rt.live), "instances": len(rt.upstreams)}
            for name, rt in self.variants.items()
        }
        return web.json_response({"status": "ok", "variants": variants})

    async def metrics_view(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
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


def build_app(router: Router) -> web.Application:
    """The aiohttp application of a router (proxy, health, metrics and admin routes)."""
    from preheat.router.admin import add_admin_routes

    app = web.Application(client_max_size=router.config.max_body_bytes)
    app.router.add_post("/v1/completions", router.proxy)
    app.router.add_post("/v1/chat/completions", router.proxy)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_view)
    add_admin_routes(app, router)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    return app


async def serve(
    router: Router,
    *,
    host: str = "127.0.0.1",
    port: int,
    ready: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run the router until SIGINT/SIGTERM."""
    import signal

    app = build_app(router)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=1024)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound = [a for a in runner.addresses if isinstance(a, tuple)]
    log.info("router listening on http://%s:%d", host, bound[0][1] if bound else port)
    # Everything allocated so far lives as long as the router: keep it out of the cyclic
    # GC's full collections, which would otherwise walk it while requests wait.
    gc.collect()
    gc.freeze()
    if ready is not None:
        await ready()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(router: Router, *, host: str = "127.0.0.1", port: int) -> None:
    """Blocking entry point: run ``serve`` on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        asyncio.run(serve(router, host=host, port=port))
        return
    uvloop.run(serve(router, host=host, port=port))
