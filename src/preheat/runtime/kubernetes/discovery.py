"""Router discovery in Kubernetes mode: instances from EndpointSlices, routing from the spec.

``preheat router serve --kubernetes --endpoint NAME`` runs the ordinary router with a
``Discovery`` beside it:

* **Instances.** Each variant ``V`` of endpoint ``E`` is served by the pods behind the
  Service :func:`variant_service_name` (``E-V``; the operator creates it). Discovery lists
  and watches that Service's EndpointSlices (label ``kubernetes.io/service-name``), in
  ``discovery.k8s.io/v1`` where the API server serves it, else ``v1beta1`` (1.20), chosen
  by API discovery. An endpoint that is ``ready`` (unset counts as ready, as the API says)
  is an instance ``http://ADDRESS:PORT`` (the slice's port named ``http``, else its
  first); one that is listed but not ready (failing its probe, or ``terminating``) is
  drained: kept, sent nothing new; one that is gone from every slice is removed.
* **KV events.** An EndpointSlice port named ``kv-events`` (the pod's ZMQ publisher,
  vLLM's ``--kv-events-config`` endpoint) makes each of its addresses publish at
  ``tcp://ADDRESS:PORT``, and one named ``kv-replay`` adds the replay endpoint; the
  router subscribes to them (router/kvevents_sub.py). How the engines hash prompts
  (``tokenizer``, ``hash``, ``hash_seed``, ``block_size``; router/kvspec.py) is the
  same for the whole endpoint: ``Discovery(..., kv_events_options="hash=sha256_cbor&
  hash_seed=0&tokenizer=/models/snap")``; default: the simulated engine's. Named ports
  need no RBAC beyond the EndpointSlices the router already reads.
* **Routing.** The ``InferenceEndpoint``'s ``spec.routing`` (strategy, prefix length,
  concurrency threshold) and the variants' weights become the router's variants; a change
  to the object is applied live. A change that does not parse is logged and ignored: the
  router keeps routing with the config it has.

The objects-to-config functions are ``runtime.kubernetes.discovery_slices``; the API
client is ``runtime.kubernetes.api_client``. ``variant_service_name`` is re-exported here
(its home is ``discovery_slices``) because docs/kubernetes.md names it
``discovery.variant_service_name``.

Every change goes through the calls the admin API makes (``RoutingState.replace_config``
and ``set_state``), on the router's event loop. The watches run in two daemon threads
(the ``kubernetes`` client is synchronous): list, then watch from the list's
``resourceVersion``; on ``410 Gone`` or any error they list again (after a back-off), so a
missed event cannot leave a stale instance behind.

Credentials: ``--kubeconfig``, else ``KUBECONFIG`` or ``~/.kube/config``, else the pod's
in-cluster ServiceAccount. The rendered router Role (``render.ROUTER_RULES``) allows
exactly what this module calls: get/list/watch EndpointSlices and InferenceEndpoints.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from preheat.control.spec import EndpointSpec
from preheat.errors import ConfigError
from preheat.router.config import RouterConfig, parse_config
from preheat.router.kvspec import parse_kv_events
from preheat.router.state import RoutingState
from preheat.runtime.kubernetes.api_client import discovery_version
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.discovery_slices import (
    SERVICE_NAME_LABEL,
    desired_instances,
    kv_event_endpoints,
    routing_variants,
    variant_service_name,
)
from preheat.runtime.kubernetes.resources import endpoint_from_object

__all__ = ["Discovery", "variant_service_name"]

log = logging.getLogger("preheat.router.kubernetes")

_PLURAL = "inferenceendpoints"
_WATCH_S = 15  # a watch call ends after this long and is renewed from its resourceVersion
_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


class Discovery:
    """Keeps a router's variants and instances in step with one InferenceEndpoint."""

    def __init__(
        self, api: client.ApiClient, namespace: str, endpoint: str, *, kv_events_options: str = ""
    ) -> None:
        self.api = api
        self.kv_events_options = kv_events_options.lstrip("?&")
        self.namespace = namespace
        self.endpoint = endpoint
        self.custom = client.CustomObjectsApi(api)
        self.version = discovery_version(api)
        self.state: RoutingState | None = None
        self.spec: EndpointSpec | None = None
        self.slices: dict[str, dict[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._watches: list[watch.Watch] = []
        self._slice_generation = 0
        self._ie_version = ""
        # (label selector, resourceVersion) of the last slice list or event: a watch
        # resumes only from a version that its own selector's list or stream gave.
        self._slice_cursor = ("", "")

    # --- start: one synchronous read, so a wrong name fails before the router listens ---

    def initial_config(self, base: RouterConfig) -> RouterConfig:
        """``base`` (timeouts, health) with the endpoint's variants and their instances now.

        Raises ``ConfigError`` naming the endpoint and namespace when it does not exist or
        the credentials may not read it.
        """
        obj = self._get_endpoint()
        self.spec = self._parse(obj)
        if self.spec is None:
            raise ConfigError(
                f"InferenceEndpoint {self.endpoint!r} in namespace {self.namespace!r} has an "
                "invalid spec (see the log); fix it with kubectl edit"
            )
        self._ie_version = obj["metadata"]["resourceVersion"]
        self.slices = self._list_slices()
        log.info(
            "endpoint %s/%s: instances from discovery.k8s.io/%s EndpointSlices of %s",
            self.namespace, self.endpoint, self.version, ", ".join(sorted(self._services())),
        )  # fmt: skip
        raw = routing_variants(self.spec, base.to_dict())
        wanted = desired_instances(self.slices.values(), self._services())
        kv = self._kv_events()
        for v in raw["variants"]:
            v["instances"] = [
                {"url": u, "kv_events": kv[u]} if u in kv else u
                for u, ready in wanted.get(v["name"], {}).items()
                if ready
            ]
        return parse_config(raw)

    def _kv_events(self) -> dict[str, str]:
        """Instance URL -> its canonical kv_events setting; a bad one is logged and left out."""
        out = {}
        raw = kv_event_endpoints(self.slices.values(), self._services(), self.kv_events_options)
        for url, value in raw.items():
            try:
                out[url] = parse_kv_events(value, where=f"instance {url}").canonical()
            except ConfigError as exc:
                log.warning("KV events of %s not used: %s", url, exc)
        return out

    def _get_endpoint(self) -> dict[str, Any]:
        try:
            obj: dict[str, Any] = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]
                GROUP, VERSION, self.namespace, _PLURAL, self.endpoint
            )
        except ApiException as exc:
            raise self._api_error(exc, f"InferenceEndpoint {self.endpoint!r}") from None
        return obj

    def _api_error(self, exc: ApiException, what: str) -> ConfigError:
        where = f"{what} in namespace {self.namespace!r}"
        if exc.status == 404:
            return ConfigError(
                f"{where} not found; create it (kubectl get inferenceendpoints -n "
                f"{self.namespace}) or give the right --endpoint/--namespace"
            )
        if exc.status in (401, 403):
            return ConfigError(
                f"reading {where} was refused ({exc.status} {exc.reason}); bind the router's "
                "ServiceAccount to the Role from `preheat k8s render`"
            )
        return ConfigError(f"reading {where} failed: {exc.status} {exc.reason}")

    def _parse(self, obj: dict[str, Any]) -> EndpointSpec | None:
        try:
            spec, _ = endpoint_from_object(obj)
        except ConfigError as exc:
            log.error("InferenceEndpoint %s/%s: %s", self.namespace, self.endpoint, exc)
            return None
        return spec

    def _services(self) -> dict[str, str]:
        assert self.spec is not None
        return {variant_service_name(self.endpoint, v.name): v.name for v in self.spec.variants}

    def _selector(self) -> str:
        return f"{SERVICE_NAME_LABEL} in ({','.join(sorted(self._services()))})"

    def _list_slices(self) -> dict[str, dict[str, Any]]:
        """Every slice of the variants' Services by name (and the cursor to watch from)."""
        selector = self._selector()
        try:
            body: dict[str, Any] = self.custom.list_namespaced_custom_object(  # type: ignore[assignment]
                "discovery.k8s.io",
                self.version,
                self.namespace,
                "endpointslices",
                label_selector=selector,
            )
        except ApiException as exc:
            raise self._api_error(exc, "EndpointSlices") from None
        self._slice_cursor = (selector, body["metadata"]["resourceVersion"])
        return {s["metadata"]["name"]: s for s in body.get("items", ())}

    # --- running ----------------------------------------------------------------------------

    def start(self, state: RoutingState, loop: asyncio.AbstractEventLoop) -> None:
        """Watch from where ``initial_config`` read; apply every change to ``state`` on
        ``loop`` (the router's)."""
        self.state = state
        self._loop = loop
        self._spawn("endpoint", self._watch_endpoint, lambda: True)
        self._spawn_slices()

    def _spawn(self, what: str, once: Callable[[], None], alive: Callable[[], bool]) -> None:
        t = threading.Thread(target=self._forever, args=(what, once, alive), daemon=True)
        t.name = f"preheat-discovery-{what}"
        t.start()

    def _spawn_slices(self) -> None:
        """A slice watcher for the current variants; the one before it (blocked on a watch
        of the old variants' Services) ends at its next event or timeout."""
        self._slice_generation += 1
        gen = self._slice_generation
        self._spawn("slices", self._watch_slices, lambda: self._slice_generation == gen)

    def stop(self) -> None:
        self._stop.set()
        for w in list(self._watches):
            w.stop()

    def _forever(self, what: str, once: Callable[[], None], alive: Callable[[], bool]) -> None:
        failures = 0
        while not self._stop.is_set() and alive():
            try:
                once()
                failures = 0
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch of %s expired (410 Gone); listing again", what)
                    self._relist(what)
                    continue
                failures += 1
                log.warning("watch of %s failed: %s %s", what, exc.status, exc.reason)
            except Exception as exc:  # connection reset, API server restarting, ...
                failures += 1
                log.warning("watch of %s failed: %r", what, exc)
            if failures:
                self._stop.wait(_BACKOFF_S[min(failures, len(_BACKOFF_S)) - 1])
                self._relist(what)

    def _relist(self, what: str) -> None:
        try:
            if what == "slices":
                self._post(self._replace_slices, self._list_slices())
            else:
                obj = self._get_endpoint()
                self._ie_version = obj["metadata"]["resourceVersion"]
                self._post(self._apply_spec, obj)
        except Exception as exc:  # ConfigError from a refused read, or the connection
            log.warning("listing %s again failed: %s", what, exc)

    def _stream(self, rv: str, **kw: Any) -> Iterable[dict[str, Any]]:
        w = watch.Watch()
        self._watches.append(w)
        try:
            yield from w.stream(
                self.custom.list_namespaced_custom_object,
                resource_version=rv,
                timeout_seconds=_WATCH_S,
                allow_watch_bookmarks=True,
                **kw,
            )
        finally:
            self._watches.remove(w)

    def _watch_slices(self) -> None:
        selector, rv = self._slice_cursor
        if selector != self._selector():  # the variants changed since the last list
            self._post(self._replace_slices, self._list_slices())
            selector, rv = self._slice_cursor
        for ev in self._stream(
            rv,
            group="discovery.k8s.io",
            version=self.version,
            namespace=self.namespace,
            plural="endpointslices",
            label_selector=selector,
        ):
            if self._slice_cursor[0] != selector:
                return  # listed again for other variants: this stream is stale
            obj = ev["object"]
            self._slice_cursor = (selector, obj["metadata"]["resourceVersion"])
            if ev["type"] != "BOOKMARK":
                self._post(self._on_slice, ev["type"], obj)

    def _watch_endpoint(self) -> None:
        for ev in self._stream(
            self._ie_version,
            group=GROUP,
            version=VERSION,
            namespace=self.namespace,
            plural=_PLURAL,
            field_selector=f"metadata.name={self.endpoint}",
        ):
            obj = ev["object"]
            self._ie_version = obj["metadata"]["resourceVersion"]
            if ev["type"] == "BOOKMARK":
                continue
            if ev["type"] == "DELETED":
                log.warning(
                    "InferenceEndpoint %s/%s was deleted; keeping the last routing config",
                    self.namespace,
                    self.endpoint,
                )
                continue
            self._post(self._apply_spec, obj)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # --- on the router's loop ------------------------------------------------------------------

    def _replace_slices(self, slices: dict[str, dict[str, Any]]) -> None:
        self.slices = slices
        self._sync_instances()

    def _on_slice(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj
        self._sync_instances()

    def _apply_spec(self, obj: dict[str, Any]) -> None:
        spec = self._parse(obj)
        if spec is None or self.state is None or spec == self.spec:
            return  # invalid (logged), not started, or a status-only update
        before = {v.name for v in self.spec.variants} if self.spec else set()
        self.spec = spec
        try:
            cfg = parse_config(routing_variants(spec, self.state.config.to_dict()))
            self.state.replace_config(cfg)
        except ConfigError as exc:
            log.error("InferenceEndpoint %s/%s: not applied: %s", self.namespace, spec.name, exc)
            return
        log.info(
            "routing from InferenceEndpoint %s/%s: %s", self.namespace, spec.name,
            spec.routing.strategy,
        )  # fmt: skip
        if {v.name for v in spec.variants} != before:
            self._spawn_slices()  # lists and watches the new variants' Services at once
        self._sync_instances()

    def _sync_instances(self) -> None:
        """Add ready instances, drain listed-but-not-ready ones, remove vanished ones."""
        state = self.state
        if state is None or self.spec is None:
            return
        wanted = desired_instances(self.slices.values(), self._services())
        kv = self._kv_events()
        cfg = state.config
        new = cfg
        for vc in cfg.variants:
            urls = wanted.get(vc.name, {})
            keep = tuple(u for u in vc.instances if u in urls)
            added = tuple(u for u, ready in urls.items() if ready and u not in vc.instances)
            events = tuple((u, kv[u]) for u in keep + added if u in kv)
            if keep != vc.instances or added or events != vc.kv_events:
                for u in added:
                    log.info("instance %s (variant %s): ready, added", u, vc.name)
                for u in set(vc.instances) - set(keep):
                    log.info("instance %s (variant %s): gone, removed", u, vc.name)
                new = new.with_variant(replace(vc, instances=keep + added, kv_events=events))
        if new is not cfg:
            state.replace_config(parse_config(new.to_dict()))
        for rt in state.variants.values():
            urls = wanted.get(rt.config.name, {})
            for url, up in rt.upstreams.items():
                ready = urls.get(url)
                if ready is False and up.state != "draining":
                    log.info("instance %s: not ready in its EndpointSlice, draining", url)
                    state.set_state(up, "draining")
                elif ready and up.state == "draining":
                    state.set_state(up, "healthy")
