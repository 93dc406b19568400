"""The router's HTTP servers on uvloop: the ``Router`` facade, the app and entry points.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (bodies forwarded
unchanged; SSE streams passed through chunk by chunk as they arrive; ``proxy.py``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` and the token-protected ``/admin``
API (``admin.py``). On the public port the raw-protocol front (``front.py``) serves the
two proxy routes and relays everything else to the aiohttp application on a private
unix socket (``serve``).

The pieces: ``state.py`` holds the variants, instances and policies and applies config
changes (no HTTP); ``health.py`` probes the instances; ``proxy.py`` forwards requests;
``upstream.py`` is the lean client for plain-HTTP instances. ``Router`` ties them to one
event loop: it starts the client session, the upstream pool and the health task when
the app starts and stops them when it stops.

Hot path: no access log; uvloop; the start-up heap is frozen out of the cyclic GC.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from preheat.router.config import RouterConfig
from preheat.router.front import Front
from preheat.router.health import HealthChecker
from preheat.router.kvevents_sub import KVEventSubscriber
from preheat.router.kvprecise import PreciseIndex
from preheat.router.policies.prefix_aware import PrefixAwarePolicy
from preheat.router.proxy import HINT_HEADER, Proxy, openai_error
from preheat.router.state import STATES, VARIANT_HEADER, RoutingState, Upstream, VariantRuntime
from preheat.router.upstream import UpstreamPool
from preheat.telemetry.routing import DecisionLog

__all__ = [
    "FRONTS",
    "HINT_HEADER",
    "STATES",
    "VARIANT_HEADER",
    "Router",
    "Upstream",
    "VariantRuntime",
    "build_app",
    "openai_error",
    "run",
    "serve",
]

log = logging.getLogger("preheat.router")


class Router(RoutingState):
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
        # The precise KV index of instances that publish KV events, and its subscriber
        # (set before the base class applies the config, which configures them).
        self.kv_index = PreciseIndex()
        self.kv_events = KVEventSubscriber(self.kv_index)
        super().__init__(config, salt=salt, rng=rng)
        self.metrics.kv_events_source = self.kv_index.status
        self.admin_token = admin_token
        self.decision_log = decision_log
        self.handlers = Proxy(self, decision_log)
        self._session: aiohttp.ClientSession | None = None
        self._pool: UpstreamPool | None = None
        self._health_task: asyncio.Task[None] | None = None

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
        self.handlers.session = self._session
        self.handlers.pool = self._pool
        self.handlers.set_timeouts()
        checker = HealthChecker(self, self._session)
        self._health_task = asyncio.create_task(checker.run(), name="router-health")
        await self.kv_events.start()

    async def stop(self, app: web.Application) -> None:
        await self.kv_events.stop()
        task = self._health_task
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

    def _apply(self, config: RouterConfig) -> None:
        """The base class's config switch, then the KV-event subscriptions follow it and
        every ``prefix_aware`` policy of a variant with a publishing instance consults
        the precise index."""
        super()._apply(config)
        endpoints = {u: e for v in config.variants for u, e in v.kv_events}
        self.kv_events.configure(endpoints, config.kv_events_silence_s)
        for rt in self.variants.values():
            if isinstance(rt.policy, PrefixAwarePolicy):
                rt.policy.precise = self.kv_index if rt.config.kv_events else None

    def snapshot(self) -> dict[str, Any]:
        """The admin config document; instances with KV events also show their endpoint
        and the precise index's status of them (state, reason, blocks, gaps)."""
        out = super().snapshot()
        status = self.kv_index.status()
        for v in out["variants"]:
            ev = dict(self.variants[v["name"]].config.kv_events)
            for inst in v["instances"]:
                if inst["url"] in ev:
                    inst["kv_events"] = ev[inst["url"]]
                    inst["kv_events_status"] = status.get(inst["url"])
        return out

    def replace_config(self, config: RouterConfig) -> None:
        """Apply a validated config live (timeouts included); restart-only fields refused."""
        super().replace_config(config)
        self.handlers.set_timeouts()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started")
        return self._session

    @property
    def pool(self) -> UpstreamPool:
        if self._pool is None:
            raise RuntimeError("the router is not started")
        return self._pool

    # --- small handlers -----------------------------------------------------------------

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


def build_app(router: Router) -> web.Application:
    """The aiohttp application of a router (proxy, health, metrics and admin routes)."""
    from preheat.router.admin import add_admin_routes

    app = web.Application(client_max_size=router.config.max_body_bytes)
    app.router.add_post("/v1/completions", router.handlers.proxy)
    app.router.add_post("/v1/chat/completions", router.handlers.proxy)
    app.router.add_get("/v1/models", router.handlers.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_view)
    add_admin_routes(app, router)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    return app


#: The servers ``serve`` can listen with (``preheat router serve --front``).
FRONTS = ("raw", "aiohttp")


async def serve(
    router: Router,
    *,
    host: str = "127.0.0.1",
    port: int,
    ready: Callable[[], Awaitable[None]] | None = None,
    front: str = "raw",
) -> None:
    """Run the router until SIGINT/SIGTERM.

    ``front="raw"`` (the default): the raw-protocol front (``front.py``) listens on
    ``host:port`` and serves the two proxy routes itself; the aiohttp application listens
    on a unix socket in a private temporary directory (mode 0700, removed on exit) and
    answers every other request, which the front relays to it. ``front="aiohttp"``:
    aiohttp listens on ``host:port`` and serves everything (the previous design).
    """
    import signal

    if front not in FRONTS:
        raise ValueError(f"front {front!r} is unknown; use one of {FRONTS}")
    app = build_app(router)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    raw: Front | None = None
    sockdir: str | None = None
    try:
        if front == "raw":
            sockdir = tempfile.mkdtemp(prefix="preheat-router-")
            path = os.path.join(sockdir, "app.sock")
            await web.UnixSite(runner, path).start()
            raw = Front(router.handlers, router.pool, f"unix:{path}")
            bound = await raw.start(host, port)
        else:
            site = web.TCPSite(runner, host, port, reuse_address=True, backlog=1024)
            await site.start()
            bound = [a[:2] for a in runner.addresses if isinstance(a, tuple)]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info(
            "router listening on http://%s:%d (front %s)",
            host,
            bound[0][1] if bound else port,
            front,
        )
        # Everything allocated so far lives as long as the router: keep it out of the
        # cyclic GC's full collections, which would otherwise walk it while requests wait.
        gc.collect()
        gc.freeze()
        if ready is not None:
            await ready()
        await stop.wait()
    finally:
        if raw is not None:
            await raw.close()
        await runner.cleanup()
        if sockdir is not None:
            shutil.rmtree(sockdir, ignore_errors=True)


def run(
    router: Router,
    *,
    host: str = "127.0.0.1",
    port: int,
    front: str = "raw",
    ready: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Blocking entry point: run ``serve`` on uvloop when it is installed; ``ready`` is
    awaited once the router listens (Kubernetes mode starts its discovery there)."""
    main = serve(router, host=host, port=port, ready=ready, front=front)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        asyncio.run(main)
        return
    uvloop.run(main)
