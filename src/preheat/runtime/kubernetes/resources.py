"""InferenceEndpoint objects <-> the local-mode endpoint spec.

The ``spec`` of an ``InferenceEndpoint`` *is* the local-mode endpoint spec in camelCase
(``metadata.name`` is the endpoint name), plus ``pod``: overrides for the pod template
(resources, tolerations, nodeSelector, serviceAccountName, env: environment variables of
the init container and the engine). Both directions go through
:func:`preheat.control.spec.parse_endpoint`, so an object the API server accepted is
validated by exactly the rules local mode applies (cross-field checks included, which
1.20's CRD schema cannot express).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from preheat.control.spec import (
    CommandEngine,
    EndpointSpec,
    ModelSpec,
    NodeSelector,
    ReplicaRange,
    SimulatedEngine,
    VariantSpec,
    parse_endpoint,
)
from preheat.errors import ConfigError
from preheat.runtime.kubernetes.crds import GROUP, VERSION

__all__ = [
    "PodOverrides",
    "endpoint_from_object",
    "endpoint_object",
    "endpoint_spec_dict",
    "load_endpoint_file",
]


@dataclass(frozen=True)
class PodOverrides:
    """``spec.pod``: what the endpoint's Deployment pod template takes as written."""

    resources: dict[str, Any] | None = None
    tolerations: tuple[dict[str, Any], ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    service_account_name: str | None = None
    #: Kubernetes ``EnvVar`` objects (``value`` or ``valueFrom``) for the init container
    #: and the engine: e.g. the origin's credentials from a Secret.
    env: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.resources is not None:
            out["resources"] = self.resources
        if self.tolerations:
            out["tolerations"] = [dict(t) for t in self.tolerations]
        if self.node_selector:
            out["nodeSelector"] = dict(self.node_selector)
        if self.service_account_name:
            out["serviceAccountName"] = self.service_account_name
        if self.env:
            out["env"] = [dict(e) for e in self.env]
        return out


class _Pod(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)
    resources: dict[str, dict[str, str | int]] | None = None
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    service_account_name: str | None = Field(None, alias="serviceAccountName")
    env: list[dict[str, Any]] = Field(default_factory=list)


#: What the rendered containers set themselves (workload.py): not to be overridden.
_RESERVED_ENV = frozenset({"POD_IP", "POD_NAME", "PREHEAT_SOURCE"})


def _pod(where: str, data: Any) -> PodOverrides:
    if data is None:
        return PodOverrides()
    try:
        raw = _Pod.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"{where}: pod.{loc} {first['msg']}; pod takes resources, tolerations, "
            "nodeSelector, serviceAccountName and env"
        ) from None
    if raw.resources is not None:
        unknown = set(raw.resources) - {"requests", "limits"}
        if unknown:
            raise ConfigError(
                f"{where}: pod.resources.{sorted(unknown)[0]} is not known; use requests, limits"
            )
    for i, e in enumerate(raw.env):
        name = e.get("name")
        if not isinstance(name, str) or not name or name in _RESERVED_ENV:
            raise ConfigError(
                f"{where}: pod.env[{i}].name {name!r} must be a variable name other than "
                f"{', '.join(sorted(_RESERVED_ENV))} (preheat sets those)"
            )
        if ("value" in e) == ("valueFrom" in e):
            raise ConfigError(
                f"{where}: pod.env[{i}] ({name}) needs exactly one of value and valueFrom"
            )
    return PodOverrides(
        resources=raw.resources,
        tolerations=tuple(raw.tolerations),
        node_selector=tuple(sorted(raw.node_selector.items())),
        service_account_name=raw.service_account_name,
        env=tuple(raw.env),
    )


def _engine(engine: SimulatedEngine | CommandEngine) -> dict[str, Any]:
    if isinstance(engine, CommandEngine):
        return {"command": engine.command}
    sim: dict[str, Any] = {"profile": engine.profile, "timeScale": engine.time_scale}
    if engine.kv_blocks is not None:
        sim["kvBlocks"] = engine.kv_blocks
    return {"simulated": sim}


def _model(model: ModelSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"source": model.source}
    if model.revision:
        out["revision"] = model.revision
    if model.fallback:
        out["fallback"] = [_model(f) for f in model.fallback]
    return out


def _replicas(r: ReplicaRange) -> dict[str, int]:
    return {"min": r.min, "max": r.max}


def _nodes(sel: NodeSelector) -> dict[str, Any]:
    if sel.names:
        return {"names": list(sel.names)}
    return {"selector": dict(sel.labels)}


def _variant(v: VariantSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": v.name,
        "weight": v.weight,
        "model": _model(v.model),
        "engine": _engine(v.engine),
        "replicas": _replicas(v.replicas),
    }
    if v.image:
        out["image"] = _image(v)
    return out


def _image(v: VariantSpec) -> str | dict[str, Any]:
    """``image`` as written: the short form unless it has an ``image.fallback`` list."""
    assert v.image is not None
    if v.image_fallback:
        return {"ref": v.image, "fallback": list(v.image_fallback)}
    return v.image


def endpoint_spec_dict(spec: EndpointSpec, pod: PodOverrides | None = None) -> dict[str, Any]:
    """The ``InferenceEndpoint.spec`` for a parsed endpoint: every variant written out in
    full (so nothing depends on defaults inherited from the top level)."""
    first = spec.variants[0]
    w = spec.cache.weights
    weights: dict[str, Any] = {
        "enabled": w.enabled,
        "nodes": _nodes(w.nodes),
        "priority": w.priority,
        "pin": w.pin,
        "timeoutSeconds": w.timeout_seconds,
    }
    if w.min_ready is not None:
        weights["minReady"] = w.min_ready
    out: dict[str, Any] = {
        "model": _model(first.model),
        "engine": _engine(first.engine),
        "replicas": _replicas(first.replicas),
        "variants": [_variant(v) for v in spec.variants],
        "routing": {
            "strategy": spec.routing.strategy,
            "prefixLength": spec.routing.prefix_length,
            "concurrencyThreshold": spec.routing.concurrency_threshold,
        },
        "modelCacheConfig": {
            "weights": weights,
            "image": {"enabled": spec.cache.image.enabled},
        },
    }
    if first.image:
        out["image"] = _image(first)
    if spec.autoscaling is not None:
        a = spec.autoscaling
        out["autoscaling"] = {
            "targetInFlight": a.target_in_flight,
            "scaleInBelow": a.scale_in_below,
            "cooldownSeconds": a.cooldown_seconds,
        }
    pod_dict = (pod or PodOverrides()).to_dict()
    if pod_dict:
        out["pod"] = pod_dict
    return out


def endpoint_object(
    spec: EndpointSpec, *, namespace: str, pod: PodOverrides | None = None
) -> dict[str, Any]:
    """The ``InferenceEndpoint`` a user applies for a local-mode endpoint spec."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceEndpoint",
        "metadata": {
            "name": spec.name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "preheat"},
        },
        "spec": endpoint_spec_dict(spec, pod),
    }


def endpoint_from_object(obj: dict[str, Any]) -> tuple[EndpointSpec, PodOverrides]:
    """Parse an ``InferenceEndpoint`` (as the API returns it) with local mode's rules."""
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    spec = dict(obj.get("spec") or {})
    where = f"InferenceEndpoint {meta.get('namespace', '?')}/{name}"
    pod = _pod(where, spec.pop("pod", None))
    return parse_endpoint({"name": name, **spec}, origin=where), pod


def load_endpoint_file(path: str | Path) -> tuple[EndpointSpec, PodOverrides]:
    """A local-mode endpoint YAML, optionally with a Kubernetes-only ``pod:`` section."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read endpoint spec {str(p)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"endpoint spec {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"endpoint spec {str(p)!r}: expected a mapping with 'name' and 'model'")
    data = dict(data)
    pod = _pod(f"endpoint spec {str(p)!r}", data.pop("pod", None))
    return parse_endpoint(data, origin=f"endpoint spec {str(p)!r}"), pod
