"""Endpoint specs and cluster documents validated at the edge (pydantic), with messages.

Decoded YAML or JSON goes through the pydantic models of ``preheat.control.spec_models``
(unknown keys and wrong types rejected); this module converts the result to the frozen
values of ``preheat.control.spec_types`` with the cross-field checks.
Every error is a ``ConfigError`` whose message names the endpoint (or the cluster file),
the field as the user wrote it, the bad value and the fix (``preheat.control.spec_errors``;
see ``preheat.control.spec``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from preheat.config import parse_size
from preheat.control.fanout import Budget
from preheat.control.spec_errors import bad, pydantic_message
from preheat.control.spec_models import (
    _Cluster,
    _Endpoint,
    _Engine,
    _ImageRef,
    _Replicas,
    _Routing,
    _Variant,
)
from preheat.control.spec_types import (
    Autoscaling,
    ClusterSpec,
    CommandEngine,
    EndpointSpec,
    EngineSpec,
    ImageCacheSpec,
    ModelCacheConfig,
    ModelSpec,
    NodeSelector,
    NodeSpec,
    OriginSpec,
    PeerSpec,
    ReplicaRange,
    RoutingSpec,
    SimulatedEngine,
    VariantSpec,
    WeightsCacheSpec,
)
from preheat.errors import ConfigError
from preheat.images.reference import parse_image_ref
from preheat.router.policies import POLICIES
from preheat.router.policies.base import CONCURRENCY_THRESHOLD_RANGE
from preheat.router.prefix import MAX_PREFIX_LENGTH, MIN_PREFIX_LENGTH

__all__ = ["check_against_cluster", "parse_cluster", "parse_endpoint"]

# Strategies, defaults and bounds are the router's (one source of truth); the messages
# here only name the spec's field.
STRATEGIES = tuple(POLICIES)
PREFIX_LENGTH_RANGE = (MIN_PREFIX_LENGTH, MAX_PREFIX_LENGTH)
CONCURRENCY_RANGE = CONCURRENCY_THRESHOLD_RANGE
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _image_parts(
    where: str, loc: str, raw: str | _ImageRef | None
) -> tuple[str | None, tuple[str, ...]]:
    """``(ref, fallbacks)`` of an ``image`` field, every reference checked."""
    if raw is None or isinstance(raw, str):
        return raw, ()
    for i, text in enumerate([raw.ref, *raw.fallback]):
        try:
            parse_image_ref(text)
        except ConfigError as exc:
            field = f"{loc}.ref" if i == 0 else f"{loc}.fallback[{i - 1}]"
            raise bad(where, f"{field} {text!r}: {exc}") from None
    if raw.ref in raw.fallback:
        raise bad(where, f"{loc}.fallback lists {raw.ref!r}, the image itself; remove it")
    return raw.ref, tuple(raw.fallback)


# --- conversion with messages that name the field -----------------------------------------


def _check_images(where: str, variants: list[VariantSpec]) -> None:
    """``modelCacheConfig.image.enabled`` needs an image, each one a valid reference."""
    images = [v.image for v in variants if v.image]
    if not images:
        raise bad(
            where,
            "modelCacheConfig.image.enabled is true but no variant has an image; set "
            "`image: REGISTRY/REPO:TAG` (at the top or per variant) or turn it off",
        )
    for text in images:
        try:
            parse_image_ref(text)
        except ConfigError as exc:
            raise bad(where, f"image {text!r} (modelCacheConfig.image): {exc}") from None


def _check_name(where: str, what: str, name: str) -> None:
    if not _NAME.match(name):
        raise bad(
            where,
            f"{what} {name!r} is not a valid name; use lower-case letters, digits and '-' "
            "(at most 63 characters, starting and ending with a letter or digit)",
        )


def _engine(where: str, loc: str, e: _Engine | None) -> EngineSpec | None:
    if e is None:
        return None
    if (e.simulated is None) == (e.command is None):
        raise bad(where, f"{loc} needs exactly one of 'simulated' or 'command'")
    if e.command is not None:
        return CommandEngine(command=e.command)
    assert e.simulated is not None
    return SimulatedEngine(
        profile=e.simulated.profile,
        time_scale=e.simulated.time_scale,
        kv_blocks=e.simulated.kv_blocks,
    )


def _replicas(where: str, loc: str, r: _Replicas) -> ReplicaRange:
    hi = r.min if r.max is None else r.max
    if r.min < 0:
        raise bad(where, f"{loc}.min {r.min} is negative; use 0 or more")
    if hi < r.min:
        raise bad(where, f"{loc}.max {hi} is below {loc}.min {r.min}; make max >= min")
    if hi < 1:
        raise bad(where, f"{loc}.max {hi} allows no replica; use max >= 1")
    return ReplicaRange(min=r.min, max=hi)


def _convert_endpoint(raw: _Endpoint) -> EndpointSpec:
    where = f"endpoint {raw.name!r}"
    _check_name(where, "name", raw.name)
    top_engine = _engine(where, "engine", raw.engine) or SimulatedEngine()
    top_replicas = _replicas(where, "replicas", raw.replicas)

    variants: list[VariantSpec] = []
    raw_variants = raw.variants if raw.variants else [_Variant(name="main")]
    seen: set[str] = set()
    for i, rv in enumerate(raw_variants):
        loc = f"variants[{i}]"
        _check_name(where, f"{loc}.name", rv.name)
        if rv.name in seen:
            raise bad(where, f"{loc}.name {rv.name!r} is used twice; give each variant its own")
        seen.add(rv.name)
        model = rv.model or raw.model
        if model is None:
            raise bad(
                where, f"{loc}.model is missing; set model.source at the top or in the variant"
            )
        if rv.weight < 0:
            raise bad(where, f"{loc}.weight {rv.weight} is negative; use a weight >= 0")
        image_ref, image_fallback = (
            _image_parts(where, f"{loc}.image", rv.image)
            if rv.image is not None
            else _image_parts(where, "image", raw.image)
        )
        variants.append(
            VariantSpec(
                name=rv.name,
                model=ModelSpec(
                    source=model.source,
                    revision=model.revision,
                    fallback=tuple(ModelSpec(f.source, f.revision) for f in model.fallback),
                ),
                image=image_ref,
                image_fallback=image_fallback,
                engine=_engine(where, f"{loc}.engine", rv.engine) or top_engine,
                replicas=_replicas(where, f"{loc}.replicas", rv.replicas)
                if rv.replicas
                else top_replicas,
                weight=rv.weight,
            )
        )
    if sum(v.weight for v in variants) <= 0:
        raise bad(where, "variants have a total weight of 0; give at least one a weight > 0")

    r = raw.routing or _Routing.model_validate({})
    if r.strategy not in STRATEGIES:
        raise bad(where, f"routing.strategy {r.strategy!r} is unknown; use {', '.join(STRATEGIES)}")
    lo, hi = PREFIX_LENGTH_RANGE
    if r.prefix_length < lo:
        raise bad(
            where,
            f"routing.prefix_length {r.prefix_length} is below {lo}; use {lo}..{hi} characters",
        )
    if r.prefix_length > hi:
        raise bad(
            where,
            f"routing.prefix_length {r.prefix_length} is above {hi}; use {lo}..{hi} characters",
        )
    clo, chi = CONCURRENCY_RANGE
    if not clo <= r.concurrency_threshold <= chi:
        raise bad(
            where,
            f"routing.concurrency_threshold {r.concurrency_threshold} is outside {clo}..{chi}; "
            "give the in-flight requests per instance at which to spill",
        )
    routing = RoutingSpec(r.strategy, r.prefix_length, r.concurrency_threshold)

    cache = ModelCacheConfig()
    mc = raw.model_cache_config
    if mc is not None:
        weights = WeightsCacheSpec()
        if mc.weights is not None:
            w = mc.weights
            if isinstance(w.nodes, list):
                selector = NodeSelector(names=tuple(w.nodes))
            elif w.nodes is not None:
                if w.nodes.names and w.nodes.selector:
                    raise bad(
                        where,
                        "modelCacheConfig.weights.nodes has both names and selector; use one",
                    )
                selector = NodeSelector(
                    names=tuple(w.nodes.names), labels=tuple(sorted(w.nodes.selector.items()))
                )
            else:
                selector = NodeSelector()
            if w.min_ready is not None and w.min_ready < 0:
                raise bad(
                    where,
                    f"modelCacheConfig.weights.minReady {w.min_ready} is negative; "
                    "use 0 (do not wait) or a node count",
                )
            if selector.names and w.min_ready is not None and w.min_ready > len(selector.names):
                raise bad(
                    where,
                    f"modelCacheConfig.weights.minReady {w.min_ready} is above the "
                    f"{len(selector.names)} listed nodes; lower it or list more nodes",
                )
            if w.timeout_seconds <= 0:
                raise bad(
                    where,
                    f"modelCacheConfig.weights.timeoutSeconds {w.timeout_seconds} must be > 0",
                )
            weights = WeightsCacheSpec(
                enabled=w.enabled,
                nodes=selector,
                min_ready=w.min_ready,
                priority=w.priority,
                pin=w.pin,
                timeout_seconds=w.timeout_seconds,
            )
        image = ImageCacheSpec(enabled=mc.image.enabled) if mc.image else ImageCacheSpec()
        if image.enabled:
            _check_images(where, variants)
        cache = ModelCacheConfig(weights=weights, image=image)

    autoscaling = None
    if raw.autoscaling is not None:
        a = raw.autoscaling
        below = a.scale_in_below if a.scale_in_below is not None else a.target_in_flight / 2
        if below >= a.target_in_flight:
            raise bad(
                where,
                f"autoscaling.scale_in_below {below:g} is not below target_in_flight "
                f"{a.target_in_flight:g}; make it smaller so scaling does not flap",
            )
        autoscaling = Autoscaling(a.target_in_flight, below, a.cooldown_seconds)

    return EndpointSpec(
        name=raw.name,
        variants=tuple(variants),
        routing=routing,
        cache=cache,
        autoscaling=autoscaling,
    )


def parse_endpoint(data: Any, *, origin: str = "endpoint spec") -> EndpointSpec:
    """Validate a decoded YAML/JSON document as an endpoint spec."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{origin}: expected a mapping with at least 'name' and 'model', "
            f"got {type(data).__name__}"
        )
    name = data.get("name")
    where = f"endpoint {name!r}" if isinstance(name, str) else origin
    try:
        raw = _Endpoint.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(pydantic_message(where, exc)) from None
    return _convert_endpoint(raw)


def _bandwidth(where: str, loc: str, value: str | int | None) -> int | None:
    if value is None:
        return None
    text = value if isinstance(value, int) else value.strip().removesuffix("/s")
    n = parse_size(text, what=f"{where}: {loc}")
    if n <= 0:
        raise bad(where, f"{loc} {value!r} must be above 0; write it like 50MiB/s")
    return n


def parse_cluster(data: Any, *, base_dir: Path, origin: str = "cluster file") -> ClusterSpec:
    """Validate a cluster document; relative store paths are taken from ``base_dir``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with 'nodes', got {type(data).__name__}")
    try:
        raw = _Cluster.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(pydantic_message(origin, exc)) from None
    if not raw.nodes:
        raise bad(origin, "nodes is empty; list at least one node")
    default_bw = _bandwidth(origin, "origin.bandwidth", raw.origin.bandwidth)
    fills = raw.origin.budget.concurrent_fills
    if fills is not None and fills < 1:
        raise bad(
            origin,
            f"origin.budget.concurrentFills {fills} must be at least 1 (origin fills at once "
            "over the cluster); leave it out for one per revision",
        )
    budget = Budget(
        concurrent_fills=fills,
        bandwidth=_bandwidth(origin, "origin.budget.bandwidth", raw.origin.budget.bandwidth),
    )
    peers = PeerSpec(enabled=raw.peers.enabled)
    nodes: list[NodeSpec] = []
    seen: set[str] = set()
    for i, n in enumerate(raw.nodes):
        loc = f"nodes[{i}]"
        _check_name(origin, f"{loc}.name", n.name)
        if n.name in seen:
            raise bad(origin, f"{loc}.name {n.name!r} is used twice; node names are unique")
        seen.add(n.name)
        if n.slots < 1:
            raise bad(origin, f"{loc}.slots {n.slots} must be at least 1 (replicas per node)")
        capacity = parse_size(n.capacity, what=f"{origin}: {loc}.capacity")
        if capacity <= 0:
            raise bad(origin, f"{loc}.capacity must be above 0; write it like 20GiB")
        store = Path(n.store) if n.store else Path("nodes") / n.name
        if not store.is_absolute():
            store = base_dir / store
        bw = _bandwidth(origin, f"{loc}.origin_bandwidth", n.origin_bandwidth)
        nodes.append(
            NodeSpec(
                name=n.name,
                store=store,
                capacity=capacity,
                labels=tuple(sorted(n.labels.items())),
                slots=n.slots,
                origin_bandwidth=bw if bw is not None else default_bw,
            )
        )
    return ClusterSpec(
        nodes=tuple(nodes), origin=OriginSpec(bandwidth=default_bw, budget=budget), peers=peers
    )


def check_against_cluster(spec: EndpointSpec, cluster: ClusterSpec) -> None:
    """Cross-checks that need both files: listed cache nodes exist, minReady is reachable."""
    where = f"endpoint {spec.name!r}"
    w = spec.cache.weights
    if not w.enabled:
        return
    names = {n.name for n in cluster.nodes}
    for name in w.nodes.names:
        if name not in names:
            raise bad(
                where,
                f"modelCacheConfig.weights.nodes names {name!r}, which is not in the cluster "
                f"({', '.join(sorted(names))}); fix the name or add the node",
            )
    targets = [n for n in cluster.nodes if w.nodes.matches(n.name, n.label_map)]
    if not targets:
        raise bad(
            where,
            f"modelCacheConfig.weights.nodes selects no node ({w.nodes.describe()}); "
            "fix the selector or label some nodes",
        )
    if w.min_ready is not None and w.min_ready > len(targets):
        raise bad(
            where,
            f"modelCacheConfig.weights.minReady {w.min_ready} is above the {len(targets)} "
            f"target nodes ({w.nodes.describe()}); lower it or target more nodes",
        )
