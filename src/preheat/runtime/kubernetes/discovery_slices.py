"""EndpointSlices and the endpoint spec to router config: pure functions of the objects.

Each variant ``V`` of endpoint ``E`` is served by the pods behind the Service
:func:`variant_service_name` (``E-V``; the operator creates it); its EndpointSlices carry
the label ``kubernetes.io/service-name``. An endpoint that is ``ready`` (unset counts as
ready, as the API says) is an instance ``http://ADDRESS:PORT`` (the slice's port named
``http``, else its first); one that is listed but not ready (failing its probe, or
``terminating``) is drained. A port named ``kv-events`` makes each address publish KV
events at ``tcp://ADDRESS:PORT``, and one named ``kv-replay`` adds the replay endpoint.
The live watches are ``runtime.kubernetes.discovery``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from preheat.control.spec import EndpointSpec

__all__ = [
    "KV_EVENTS_PORT",
    "KV_REPLAY_PORT",
    "SERVICE_NAME_LABEL",
    "SliceEndpoint",
    "desired_instances",
    "kv_event_endpoints",
    "routing_variants",
    "slice_endpoints",
    "variant_service_name",
]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def variant_service_name(endpoint: str, variant: str) -> str:
    """The Service in front of one variant's pods: ``ENDPOINT-VARIANT`` (a DNS label; a
    longer pair keeps 54 characters and a digest of the whole)."""
    name = f"{endpoint}-{variant}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-')}-{digest}"


@dataclass(frozen=True)
class SliceEndpoint:
    """One address of an EndpointSlice as the router sees it."""

    url: str
    ready: bool
    # tcp://ADDRESS:PORT of the slice's kv-events port (and ?replay=... of kv-replay)
    kv_events: str | None = None


KV_EVENTS_PORT = "kv-events"
KV_REPLAY_PORT = "kv-replay"


def slice_endpoints(obj: Mapping[str, Any]) -> list[SliceEndpoint]:
    """The instance URLs of one EndpointSlice (v1 or v1beta1), each ready or not."""
    ports = obj.get("ports") or []
    port = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else None)
    if port is None or port.get("port") is None:
        return []
    named = {p.get("name"): p.get("port") for p in ports}
    kv, replay = named.get(KV_EVENTS_PORT), named.get(KV_REPLAY_PORT)
    out = []
    for e in obj.get("endpoints") or ():
        cond = e.get("conditions") or {}
        ready = cond.get("ready") is not False and not cond.get("terminating")
        for addr in e.get("addresses") or ():
            host = f"[{addr}]" if ":" in addr else addr
            ev = f"tcp://{host}:{kv}" if kv else None
            if ev and replay:
                ev += f"?replay=tcp://{host}:{replay}"
            out.append(SliceEndpoint(f"http://{host}:{port['port']}", ready, ev))
    return out


def kv_event_endpoints(
    slices: Iterable[Mapping[str, Any]], services: Mapping[str, str], options: str = ""
) -> dict[str, str]:
    """Instance URL -> its kv_events setting (router/kvspec.py) for the addresses of the
    variants' slices that have a ``kv-events`` port; ``options`` (``hash=...&...``) added."""
    out: dict[str, str] = {}
    for s in slices:
        labels = s.get("metadata", {}).get("labels") or {}
        if str(labels.get(SERVICE_NAME_LABEL)) not in services:
            continue
        for e in slice_endpoints(s):
            if e.kv_events:
                sep = "&" if "?" in e.kv_events else "?"
                out[e.url] = e.kv_events + (sep + options if options else "")
    return out


def desired_instances(
    slices: Iterable[Mapping[str, Any]], services: Mapping[str, str]
) -> dict[str, dict[str, bool]]:
    """Per variant, each instance URL and whether it is ready, from the slices of the
    variants' Services (``services``: Service name -> variant). An address that one slice
    lists as ready is ready."""
    out: dict[str, dict[str, bool]] = {v: {} for v in services.values()}
    for s in slices:
        labels = s.get("metadata", {}).get("labels") or {}
        variant = services.get(str(labels.get(SERVICE_NAME_LABEL)))
        if variant is None:
            continue
        for e in slice_endpoints(s):
            out[variant][e.url] = out[variant].get(e.url, False) or e.ready
    return out


def routing_variants(spec: EndpointSpec, current: Mapping[str, Any]) -> dict[str, Any]:
    """The router config document ``current`` (``RouterConfig.to_dict``) with one variant
    per endpoint variant, strategy, thresholds and weight from the spec; a variant that
    stays keeps its instances and its other parameters."""
    raw = dict(current)
    old = {v["name"]: v for v in current.get("variants", ())}
    r = spec.routing
    raw["variants"] = [
        {
            **old.get(v.name, {"name": v.name, "instances": []}),
            "weight": v.weight,
            "strategy": r.strategy,
            "prefix_length": r.prefix_length,
            "concurrency_threshold": r.concurrency_threshold,
        }
        for v in spec.variants
    ]
    return raw
