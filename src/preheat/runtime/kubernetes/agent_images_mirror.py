"""The node mirror the agent serves (``preheat agent --mirror-port P``).

The read-only registry mirror of :mod:`preheat.images.mirror` over the agent's own store:
the images the agent pre-pulled (and anything else the store holds) are served to the
node's container runtime, everything else falls through to ``--mirror-upstream`` (or is
a registry-style 404). containerd reaches it through the rendered ``hosts.toml``
(``preheat k8s render --containerd-mirror REGISTRY``), which points at
``http://127.0.0.1:P``: the DaemonSet runs on the host network so the node's containerd
(a host process) reaches that loopback port, and the mirror binds loopback only (the cache
has no per-repository access control of its own).

``/metrics`` of the agent counts the mirror's answers: ``preheat_agent_mirror_requests``
by ``result`` (``hit``: served from the store; ``miss``: forwarded upstream or 404) and
``preheat_agent_mirror_bytes`` by ``result`` (GET bodies, from their ``Content-Length``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import Counter

from preheat.images.cache import ImageCache
from preheat.images.mirror import Mirror
from preheat.runtime.kubernetes.agent_metrics import AgentMetrics

__all__ = ["start_mirror"]


def _counted(metrics: AgentMetrics) -> tuple[Counter, Counter]:
    r = metrics.telemetry.registry
    requests = Counter("preheat_agent_mirror_requests", "Node mirror answers by result",
                       ["result"], registry=r)  # fmt: skip
    nbytes = Counter("preheat_agent_mirror_bytes", "Node mirror bytes served by result",
                     ["result"], registry=r)  # fmt: skip
    return requests, nbytes


def mirror_app(cache: ImageCache, upstream: str | None, metrics: AgentMetrics) -> web.Application:
    """The mirror's app with the hit/miss counters attached."""
    requests, nbytes = _counted(metrics)

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        resp: web.StreamResponse = await handler(request)
        if request.path.rstrip("/") == "/v2" or request.method not in ("GET", "HEAD"):
            return resp
        if resp.prepared:  # streamed from the upstream inside the handler
            result = "miss"
        elif resp.status in (200, 206):
            result = "hit"
        elif resp.status in (404, 502):
            result = "miss"
        else:
            return resp
        request["preheat_mirror"] = result
        requests.labels(result).inc()
        return resp

    async def on_prepare(request: web.Request, resp: web.StreamResponse) -> None:
        if request.method != "GET" or resp.status not in (200, 206):
            return
        if request.path.rstrip("/") == "/v2":
            return
        # a streamed miss prepares inside the handler, before the middleware has seen it
        nbytes.labels(request.get("preheat_mirror", "miss")).inc(resp.content_length or 0)

    app = Mirror(cache, upstream).app()
    app.middlewares.append(count)
    app.on_response_prepare.append(on_prepare)
    return app


async def start_mirror(
    cache: ImageCache, host: str, port: int, upstream: str | None, metrics: AgentMetrics
) -> tuple[web.AppRunner, int]:
    """Start the mirror on ``host:port`` (0: any free port); returns the runner and port."""
    runner = web.AppRunner(mirror_app(cache, upstream, metrics), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])
