"""``preheat metrics-adapter``: the External metrics API for the rendered HPAs.

An extension API server (aiohttp, TLS) registered with the aggregator by the ``APIService``
``v1beta1.external.metrics.k8s.io`` (``render_adapter.py``). It serves what
:mod:`~preheat.runtime.kubernetes.metrics_adapter_core` describes:
``preheat_router_in_flight`` per endpoint variant, read at request time.

**Where the number comes from.** For ``namespaces/NS/preheat_router_in_flight`` with a
selector that pins ``endpoint=E`` (the rendered HPA always does): the EndpointSlices of
the router Service ``preheat-router-E`` in ``NS`` (listed the way router discovery lists
the variants' slices: ``api_client.connect``, ``discovery_version``,
``discovery_slices.slice_endpoints``);
every ready address's ``/metrics`` is scraped (concurrently, ``--scrape-timeout`` each) and
its ``preheat_router_in_flight`` samples summed per variant. Nothing is cached: each HPA
sync sees the routers as they are. A router that is listed ready but does not answer
makes the request fail (503 naming it) rather than return a sum without it, which the
HPA would read as less load and scale down on; the HPA keeps its count meanwhile. No
ready router: an empty list (no series), the HPA also keeps its count.

**Authentication and authorization (delegated, like every aggregated API server).** At
start the adapter reads ``kube-system/extension-apiserver-authentication`` (the
``extension-apiserver-authentication-reader`` Role): the front-proxy client CA, allowed
names and header names. A request is accepted only over a client certificate that CA
signed (the aggregator's ``--proxy-client-cert-file``) with an allowed common name; the
user and groups are then the ``X-Remote-User``/``X-Remote-Group`` headers. Anything else
is 401: bearer tokens are not accepted, so the adapter needs no ``TokenReview`` (and not
``system:auth-delegator``'s ``tokenreviews`` grant). Each request is authorized with a
``SubjectAccessReview`` (``list`` on the metric in ``external.metrics.k8s.io`` in the
namespace, as the API server would name it; ``get`` on the discovery path), cached for
``--authz-cache`` seconds per identity and attribute.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from preheat.errors import ConfigError, PreheatError
from preheat.runtime.kubernetes.api_client import discovery_version
from preheat.runtime.kubernetes.autoscaler import IN_FLIGHT_METRIC
from preheat.runtime.kubernetes.discovery_slices import SERVICE_NAME_LABEL, slice_endpoints
from preheat.runtime.kubernetes.metrics_adapter_core import (
    GROUP,
    GROUP_VERSION,
    METRICS,
    VERSION,
    Requirement,
    api_resource_list,
    in_flight_by_variant,
    parse_selector,
    pinned,
    router_service_name,
    selector_matches,
    status_body,
    value_list,
)
from preheat.runtime.kubernetes.metrics_adapter_tls import (
    ServingCert,
    peer_common_name,
    server_context,
)

__all__ = ["AdapterConfig", "FrontProxy", "MetricsAdapter", "RouterScrapeFailed", "serve"]

log = logging.getLogger("preheat.metrics_adapter")

AUTH_CONFIGMAP = ("kube-system", "extension-apiserver-authentication")
_PREFIX = f"/apis/{GROUP_VERSION}"


class RouterScrapeFailed(PreheatError, ConnectionError):
    """A router listed ready in its EndpointSlice did not answer ``/metrics``."""


@dataclass(frozen=True)
class AdapterConfig:
    """What ``preheat metrics-adapter`` was asked to do."""

    host: str = "127.0.0.1"
    port: int = 6443
    serving: ServingCert | None = None
    #: Seconds one router's /metrics may take.
    scrape_timeout_s: float = 2.0
    #: Seconds a SubjectAccessReview answer is reused for the same identity and request.
    authz_cache_s: float = 10.0


@dataclass(frozen=True)
class FrontProxy:
    """The request-header authentication the API server publishes for extension servers."""

    client_ca_pem: str
    allowed_names: tuple[str, ...]
    user_headers: tuple[str, ...] = ("X-Remote-User",)
    group_headers: tuple[str, ...] = ("X-Remote-Group",)
    extra_prefixes: tuple[str, ...] = ("X-Remote-Extra-",)

    @classmethod
    def from_configmap(cls, data: Mapping[str, str]) -> FrontProxy:
        """From ``extension-apiserver-authentication``'s data; raises ``ConfigError`` when
        the API server publishes no front-proxy CA."""
        ca = data.get("requestheader-client-ca-file")
        if not ca:
            raise ConfigError(
                "kube-system/extension-apiserver-authentication has no "
                "requestheader-client-ca-file: start kube-apiserver with "
                "--requestheader-client-ca-file and --proxy-client-cert-file/-key-file "
                "(the aggregator's client certificate)"
            )

        def names(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
            raw = data.get(key)
            return tuple(json.loads(raw)) if raw else default

        return cls(
            ca,
            names("requestheader-allowed-names", ()),
            names("requestheader-username-headers", cls.user_headers),
            names("requestheader-group-headers", cls.group_headers),
            names("requestheader-extra-headers-prefix", cls.extra_prefixes),
        )

    def identity(
        self, peercert: Mapping[str, Any] | None, headers: Any
    ) -> tuple[str, list[str], dict[str, list[str]]] | str:
        """``(user, groups, extra)`` of a request, or the reason it is unauthenticated."""
        cn = peer_common_name(peercert)
        if cn is None:
            return "no front-proxy client certificate (call through the API server)"
        if self.allowed_names and cn not in self.allowed_names:
            return f"client certificate {cn!r} is not among requestheader-allowed-names"
        user = next((headers[h] for h in self.user_headers if headers.get(h)), None)
        if not user:
            return "the front proxy named no user"
        groups = [g for h in self.group_headers for g in headers.getall(h, [])]
        extra: dict[str, list[str]] = {}
        for name in headers:
            for p in self.extra_prefixes:
                if name.lower().startswith(p.lower()):
                    key = urllib.parse.unquote(name[len(p) :]).lower()
                    extra[key] = headers.getall(name, [])
        return user, groups, extra


@dataclass
class MetricsAdapter:
    """The aiohttp application and the Kubernetes calls behind it."""

    api: client.ApiClient
    front_proxy: FrontProxy
    config: AdapterConfig = field(default_factory=AdapterConfig)
    slice_version: str = ""
    _authz: dict[tuple[Any, ...], tuple[float, bool, str]] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = None

    @classmethod
    def connect(cls, api: client.ApiClient, config: AdapterConfig) -> MetricsAdapter:
        """Read the front-proxy settings and the EndpointSlice version; raises
        ``ConfigError`` naming what is missing or refused."""
        version = discovery_version(api)  # first: names an unreachable API server
        ns, name = AUTH_CONFIGMAP
        try:
            cm = client.CoreV1Api(api).read_namespaced_config_map(name, ns)
        except ApiException as exc:
            raise ConfigError(
                f"reading ConfigMap {ns}/{name} failed ({exc.status} {exc.reason}); bind the "
                "adapter's ServiceAccount to the Role extension-apiserver-authentication-reader "
                "in kube-system (preheat k8s render does)"
            ) from None
        return cls(api, FrontProxy.from_configmap(cm.data or {}), config, version)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._healthz)
        app.router.add_get(_PREFIX, self._discovery)
        app.router.add_get(_PREFIX + "/namespaces/{namespace}/{metric}", self._metric)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    # --- handlers ----------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _discovery(self, request: web.Request) -> web.Response:
        denied = await self._authorize(request, None, {"path": _PREFIX, "verb": "get"})
        return denied or web.json_response(api_resource_list())

    async def _metric(self, request: web.Request) -> web.Response:
        ns, metric = request.match_info["namespace"], request.match_info["metric"]
        attrs = {"namespace": ns, "verb": "list", "group": GROUP, "version": VERSION,
                 "resource": metric}  # fmt: skip
        denied = await self._authorize(request, attrs, None)
        if denied:
            return denied
        if metric not in METRICS:
            return _fail(404, f"external metric {metric!r} is not served; this adapter "
                              f"serves {', '.join(METRICS)}")  # fmt: skip
        try:
            reqs = parse_selector(request.query.get("labelSelector", ""))
        except ConfigError as exc:
            return _fail(400, str(exc))
        endpoint = pinned(reqs, "endpoint")
        if endpoint is None:
            return _fail(400, f"{metric} needs endpoint=NAME in the metric selector (the "
                              "rendered HPA sets it); it names the router to read")  # fmt: skip
        try:
            series = await self._in_flight(ns, endpoint, reqs)
        except (RouterScrapeFailed, ConfigError) as exc:
            log.warning("%s/%s for endpoint %s: %s", ns, metric, endpoint, exc)
            return _fail(503, str(exc))
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return web.json_response(value_list(metric, series, timestamp=now))

    # --- authorization -------------------------------------------------------------------

    async def _authorize(
        self,
        request: web.Request,
        resource: Mapping[str, str] | None,
        non_resource: Mapping[str, str] | None,
    ) -> web.Response | None:
        """None when the request may proceed, else the 401/403 to answer."""
        transport = request.transport
        peercert = transport.get_extra_info("peercert") if transport is not None else None
        who = self.front_proxy.identity(peercert, request.headers)
        if isinstance(who, str):
            return _fail(401, f"unauthenticated: {who}")
        user, groups, extra = who
        key = (user, tuple(groups), json.dumps(extra, sort_keys=True),
               json.dumps(resource or non_resource, sort_keys=True))  # fmt: skip
        now = time.monotonic()
        hit = self._authz.get(key)
        if hit is None or now - hit[0] > self.config.authz_cache_s:
            try:
                allowed, reason = await asyncio.to_thread(
                    self._review, user, groups, extra, resource, non_resource
                )
            except ApiException as exc:
                return _fail(503, f"SubjectAccessReview failed ({exc.status} {exc.reason}); "
                                  "the adapter's ClusterRole must allow creating them")  # fmt: skip
            hit = (now, allowed, reason)
            self._authz[key] = hit
        if hit[1]:
            return None
        what = (
            f"list {GROUP}/{resource['resource']} in namespace {resource['namespace']}"
            if resource
            else f"get {non_resource['path'] if non_resource else ''}"
        )
        return _fail(403, f"user {user!r} may not {what}{': ' + hit[2] if hit[2] else ''}")

    def _review(
        self,
        user: str,
        groups: Sequence[str],
        extra: Mapping[str, list[str]],
        resource: Mapping[str, str] | None,
        non_resource: Mapping[str, str] | None,
    ) -> tuple[bool, str]:
        spec: dict[str, Any] = {"user": user, "groups": list(groups), "extra": dict(extra)}
        if resource:
            spec["resourceAttributes"] = dict(resource)
        else:
            spec["nonResourceAttributes"] = dict(non_resource or {})
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": spec}  # fmt: skip
        out = client.AuthorizationV1Api(self.api).create_subject_access_review(body)  # type: ignore[arg-type]
        status = out.status
        if status is None:
            return False, "the SubjectAccessReview came back without a status"
        return bool(status.allowed), str(status.reason or "")

    # --- the number ----------------------------------------------------------------------

    def _router_urls(self, namespace: str, endpoint: str) -> list[str]:
        """The ready router addresses of ``endpoint`` (its Service's EndpointSlices)."""
        service = router_service_name(endpoint)
        try:
            body: dict[str, Any] = client.CustomObjectsApi(self.api).list_namespaced_custom_object(  # type: ignore[assignment]
                "discovery.k8s.io", self.slice_version, namespace, "endpointslices",
                label_selector=f"{SERVICE_NAME_LABEL}={service}",
            )  # fmt: skip
        except ApiException as exc:
            raise ConfigError(
                f"listing the EndpointSlices of {namespace}/{service} failed "
                f"({exc.status} {exc.reason}); the adapter's ClusterRole must allow it"
            ) from None
        urls = {e.url for s in body.get("items", ()) for e in slice_endpoints(s) if e.ready}
        return sorted(urls)

    async def _scrape(self, url: str) -> list[tuple[dict[str, str], float]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.scrape_timeout_s)
            )
        try:
            async with self._session.get(url + "/metrics") as r:
                if r.status != 200:
                    raise RouterScrapeFailed(f"router {url}/metrics answered {r.status}")
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RouterScrapeFailed(
                f"router {url}/metrics did not answer ({str(exc) or type(exc).__name__}); "
                "not summing without it"
            ) from None
        out = []
        for fam in text_string_to_metric_families(text):
            if fam.name == IN_FLIGHT_METRIC:
                out += [(dict(s.labels), float(s.value)) for s in fam.samples]
        return out

    async def _in_flight(
        self, namespace: str, endpoint: str, reqs: Sequence[Requirement]
    ) -> list[tuple[dict[str, str], float]]:
        urls = await asyncio.to_thread(self._router_urls, namespace, endpoint)
        if not urls:
            return []
        scraped = await asyncio.gather(*(self._scrape(u) for u in urls))
        sums = in_flight_by_variant(s for one in scraped for s in one)
        variant = pinned(reqs, "variant")
        if variant is not None:
            sums.setdefault(variant, 0.0)  # routers answered: nothing in flight is a 0
        series = [({"endpoint": endpoint, "variant": v}, n) for v, n in sorted(sums.items())]
        return [(labels, n) for labels, n in series if selector_matches(reqs, labels)]


def _fail(code: int, message: str) -> web.Response:
    return web.json_response(status_body(code, message), status=code)


async def serve(adapter: MetricsAdapter, *, ready: Any = None) -> None:
    """Serve ``adapter`` over TLS until cancelled; ``ready(port)`` is called once listening."""
    cfg = adapter.config
    if cfg.serving is None:
        raise ConfigError("the metrics adapter needs a serving certificate")
    ctx = server_context(cfg.serving, adapter.front_proxy.client_ca_pem)
    runner = web.AppRunner(adapter.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=ctx)
    try:
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else cfg.port
        log.info("external metrics API on https://%s:%d%s", cfg.host, port, _PREFIX)
        if ready is not None:
            ready(port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
