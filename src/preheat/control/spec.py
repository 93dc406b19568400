"""The endpoint spec and the local cluster file: validated once at the edge, frozen inside.

YAML (or a dict from an HTTP body) goes through pydantic models that reject unknown keys
and wrong types; the result is converted to frozen dataclasses that the planner and the
executor use. Every error is a ``ConfigError`` whose message names the endpoint (or the
cluster file), the field as the user wrote it, the bad value and the fix::

    endpoint 'chat': routing.prefix_length 100 is below 1024; use 1024..65536 characters

Endpoint shape (``camelCase`` and ``snake_case`` keys are both accepted)::

    name: chat
    model: {source: http://origin/llama/preheat-manifest.json, revision: <optional digest>}
    image: registry/vllm:0.6          # optional
    engine: {simulated: {profile: tiny, time_scale: 0.01}}
            # or {command: "vllm serve {snapshot} --port {port}"}
    replicas: {min: 2, max: 4}
    autoscaling: {target_in_flight: 8}   # optional: in-flight requests per replica
    variants:                            # optional; default: one variant named "main"
      - {name: a, weight: 90}
      - {name: b, weight: 10, model: {source: ...}}
    routing: {strategy: prefix_aware, prefix_length: 2048, concurrency_threshold: 8}
    modelCacheConfig:
      weights: {enabled: true, nodes: {selector: {gpu: "yes"}}, minReady: 2,
                priority: 10, pin: true, timeoutSeconds: 600}
      image: {enabled: false}

Cluster shape::

    origin: {bandwidth: 50MiB/s}        # default per-node limit on origin downloads
    nodes:
      - {name: node-a, store: nodes/a, capacity: 20GiB, labels: {gpu: "yes"}, slots: 2,
         origin_bandwidth: 40MiB/s}
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from preheat.artifacts.refs import parse_ref
from preheat.config import parse_size
from preheat.errors import ConfigError

__all__ = [
    "Autoscaling",
    "ClusterSpec",
    "CommandEngine",
    "EndpointSpec",
    "ImageCacheSpec",
    "ModelCacheConfig",
    "ModelSpec",
    "NodeSelector",
    "NodeSpec",
    "OriginSpec",
    "ReplicaRange",
    "RoutingSpec",
    "SimulatedEngine",
    "VariantSpec",
    "WeightsCacheSpec",
    "check_against_cluster",
    "default_cluster",
    "load_cluster",
    "load_endpoint",
    "parse_cluster",
    "parse_endpoint",
]

STRATEGIES = ("random", "least_outstanding", "prefix_aware")
PREFIX_LENGTH_RANGE = (1024, 65536)
CONCURRENCY_RANGE = (1, 1024)
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_COMMAND_FIELDS = {"snapshot", "port", "host", "model", "replica"}


# --- frozen values used inside -----------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """Where the weights come from. ``revision``, when given, must match what the source
    resolves to (a manifest digest); otherwise the endpoint pins what it resolves at apply."""

    source: str
    revision: str | None = None


@dataclass(frozen=True)
class SimulatedEngine:
    """The built-in simulated engine (``preheat engine serve``)."""

    profile: str = "tiny"
    time_scale: float = 1.0
    kv_blocks: int | None = None


@dataclass(frozen=True)
class CommandEngine:
    """Any OpenAI-compatible server started by a command line with ``{snapshot}`` and
    ``{port}`` placeholders (also ``{host}``, ``{model}``, ``{replica}``)."""

    command: str


EngineSpec = SimulatedEngine | CommandEngine


@dataclass(frozen=True)
class ReplicaRange:
    """Replica count bounds; an endpoint starts at ``min``."""

    min: int = 1
    max: int = 1


@dataclass(frozen=True)
class Autoscaling:
    """Scale on in-flight requests per replica (router-measured)."""

    target_in_flight: float
    scale_in_below: float
    cooldown_seconds: float = 10.0


@dataclass(frozen=True)
class VariantSpec:
    """A production variant: model revision, image, engine, replica bounds, traffic weight."""

    name: str
    model: ModelSpec
    image: str | None
    engine: EngineSpec
    replicas: ReplicaRange
    weight: float = 1.0


@dataclass(frozen=True)
class RoutingSpec:
    """Router strategy for every variant of the endpoint."""

    strategy: str = "random"
    prefix_length: int = 2048
    concurrency_threshold: int = 16


@dataclass(frozen=True)
class NodeSelector:
    """Which nodes a cache targets: all (empty), an explicit list, or label matches."""

    names: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        if self.names:
            return name in self.names
        return all(labels.get(k) == v for k, v in self.labels)

    def describe(self) -> str:
        if self.names:
            return "nodes " + ", ".join(self.names)
        if self.labels:
            return "nodes with " + ", ".join(f"{k}={v}" for k, v in self.labels)
        return "all nodes"


@dataclass(frozen=True)
class WeightsCacheSpec:
    """``modelCacheConfig.weights``: warm the revision on target nodes before deploying."""

    enabled: bool = False
    nodes: NodeSelector = field(default_factory=NodeSelector)
    #: Replicas are not created until this many target nodes are ready; ``None`` = all
    #: target nodes that can hold the model.
    min_ready: int | None = None
    priority: int = 0
    pin: bool = False
    #: After this long waiting for ``min_ready``, deploy anyway (and say so).
    timeout_seconds: float = 600.0


@dataclass(frozen=True)
class ImageCacheSpec:
    """``modelCacheConfig.image``: pre-pull the image (does not gate deployment)."""

    enabled: bool = False


@dataclass(frozen=True)
class ModelCacheConfig:
    weights: WeightsCacheSpec = field(default_factory=WeightsCacheSpec)
    image: ImageCacheSpec = field(default_factory=ImageCacheSpec)


@dataclass(frozen=True)
class EndpointSpec:
    """A served model: its variants, routing and cache configuration."""

    name: str
    variants: tuple[VariantSpec, ...]
    routing: RoutingSpec
    cache: ModelCacheConfig
    autoscaling: Autoscaling | None = None

    def variant(self, name: str) -> VariantSpec:
        for v in self.variants:
            if v.name == name:
                return v
        known = ", ".join(v.name for v in self.variants)
        raise ConfigError(f"endpoint {self.name!r} has no variant {name!r}; it has {known}")


@dataclass(frozen=True)
class OriginSpec:
    """Cluster-wide origin settings."""

    #: Default per-node origin download limit in bytes/s (``None``: unlimited).
    bandwidth: int | None = None


@dataclass(frozen=True)
class NodeSpec:
    """One local node: a store directory with a disk budget, labels and replica slots."""

    name: str
    store: Path
    capacity: int
    labels: tuple[tuple[str, str], ...] = ()
    slots: int = 2
    #: Origin download limit for this node in bytes/s (``None``: unlimited).
    origin_bandwidth: int | None = None

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]
    origin: OriginSpec = field(default_factory=OriginSpec)

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(
            f"cluster has no node {name!r}; known nodes: {', '.join(n.name for n in self.nodes)}"
        )


# --- pydantic models at the edge ---------------------------------------------------------


class _Edge(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class _Model(_Edge):
    source: str
    revision: str | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", v):
            raise ValueError(
                f"{v!r} is not a source ref; use file:///dir, "
                "http(s)://.../preheat-manifest.json or s3://bucket/prefix"
            )
        try:
            parse_ref(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v


class _Simulated(_Edge):
    profile: str = "tiny"
    time_scale: float = Field(1.0, alias="timeScale")
    kv_blocks: int | None = Field(None, alias="kvBlocks")

    @field_validator("time_scale")
    @classmethod
    def _scale(cls, v: float) -> float:
        if v < 0:
            raise ValueError(f"{v} is negative; use 0 (instant) up to 1 (real time)")
        return v


class _Engine(_Edge):
    simulated: _Simulated | None = None
    command: str | None = None

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | None) -> str | None:
        if v is None:
            return v
        names = {f[1] for f in string.Formatter().parse(v) if f[1] is not None}
        unknown = names - _COMMAND_FIELDS
        if unknown:
            raise ValueError(
                f"placeholder {{{sorted(unknown)[0]}}} is unknown; "
                f"use {', '.join('{' + n + '}' for n in sorted(_COMMAND_FIELDS))}"
            )
        if "port" not in names:
            raise ValueError("has no {port}; the replica must listen on the port preheat gives it")
        return v


class _Replicas(_Edge):
    min: int = 1
    max: int | None = None


class _Autoscaling(_Edge):
    target_in_flight: float = Field(alias="targetInFlight", gt=0)
    scale_in_below: float | None = Field(None, alias="scaleInBelow", ge=0)
    cooldown_seconds: float = Field(10.0, alias="cooldownSeconds", ge=0)


class _Variant(_Edge):
    name: str
    weight: float = 1.0
    model: _Model | None = None
    image: str | None = None
    engine: _Engine | None = None
    replicas: _Replicas | None = None


class _Routing(_Edge):
    strategy: str = "random"
    prefix_length: int = Field(2048, alias="prefixLength")
    concurrency_threshold: int = Field(16, alias="concurrencyThreshold")


class _Nodes(_Edge):
    selector: dict[str, str] = Field(default_factory=dict)
    names: list[str] = Field(default_factory=list)


class _Weights(_Edge):
    enabled: bool = True
    nodes: _Nodes | list[str] | None = None
    min_ready: int | None = Field(None, alias="minReady")
    priority: int = 0
    pin: bool = False
    timeout_seconds: float = Field(600.0, alias="timeoutSeconds")


class _Image(_Edge):
    enabled: bool = False


class _CacheConfig(_Edge):
    weights: _Weights | None = None
    image: _Image | None = None


class _Endpoint(_Edge):
    name: str
    model: _Model | None = None
    image: str | None = None
    engine: _Engine | None = None
    replicas: _Replicas = Field(default_factory=_Replicas)
    autoscaling: _Autoscaling | None = None
    variants: list[_Variant] | None = None
    routing: _Routing | None = None
    model_cache_config: _CacheConfig | None = Field(None, alias="modelCacheConfig")


class _Origin(_Edge):
    bandwidth: str | int | None = None


class _Node(_Edge):
    name: str
    store: str | None = None
    capacity: str | int = "100GiB"
    labels: dict[str, str] = Field(default_factory=dict)
    slots: int = 2
    origin_bandwidth: str | int | None = Field(None, alias="originBandwidth")


class _Cluster(_Edge):
    origin: _Origin = Field(default_factory=_Origin)
    nodes: list[_Node]


# --- conversion with messages that name the field -----------------------------------------


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic reports union members by class name; they are not user fields.
            if part.startswith("_") or part in {"list[str]", "str", "int", "function-after"}:
                continue
            out += ("." if out else "") + part
    return out


def _pydantic_message(where: str, exc: ValidationError) -> str:
    lines = []
    errors = exc.errors()
    if len(errors) > 1:
        # A union (``nodes: {selector} | [names]``) reports one error per member; the
        # "should be a list" complaint only hides the real one.
        errors = [e for e in errors if e["type"] != "list_type"] or errors
    for err in errors:
        loc = _loc(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "is not a known field; check its spelling (see docs/fleet.md for the shape)"
        elif err["type"] == "missing":
            msg = "is required"
        elif "input" in err and err["type"] != "value_error":
            msg = f"{err['input']!r}: {msg}"
        lines.append(f"{where}: {loc} {msg}".replace(":  ", ": "))
    # One line per problem, de-duplicated (union members can repeat one complaint).
    return "\n".join(dict.fromkeys(lines))


def _bad(where: str, text: str) -> ConfigError:
    return ConfigError(f"{where}: {text}")


def _check_name(where: str, what: str, name: str) -> None:
    if not _NAME.match(name):
        raise _bad(
            where,
            f"{what} {name!r} is not a valid name; use lower-case letters, digits and '-' "
            "(at most 63 characters, starting and ending with a letter or digit)",
        )


def _engine(where: str, loc: str, e: _Engine | None) -> EngineSpec | None:
    if e is None:
        return None
    if (e.simulated is None) == (e.command is None):
        raise _bad(where, f"{loc} needs exactly one of 'simulated' or 'command'")
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
        raise _bad(where, f"{loc}.min {r.min} is negative; use 0 or more")
    if hi < r.min:
        raise _bad(where, f"{loc}.max {hi} is below {loc}.min {r.min}; make max >= min")
    if hi < 1:
        raise _bad(where, f"{loc}.max {hi} allows no replica; use max >= 1")
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
            raise _bad(where, f"{loc}.name {rv.name!r} is used twice; give each variant its own")
        seen.add(rv.name)
        model = rv.model or raw.model
        if model is None:
            raise _bad(
                where, f"{loc}.model is missing; set model.source at the top or in the variant"
            )
        if rv.weight < 0:
            raise _bad(where, f"{loc}.weight {rv.weight} is negative; use a weight >= 0")
        variants.append(
            VariantSpec(
                name=rv.name,
                model=ModelSpec(source=model.source, revision=model.revision),
                image=rv.image if rv.image is not None else raw.image,
                engine=_engine(where, f"{loc}.engine", rv.engine) or top_engine,
                replicas=_replicas(where, f"{loc}.replicas", rv.replicas)
                if rv.replicas
                else top_replicas,
                weight=rv.weight,
            )
        )
    if sum(v.weight for v in variants) <= 0:
        raise _bad(where, "variants have a total weight of 0; give at least one a weight > 0")

    r = raw.routing or _Routing.model_validate({})
    if r.strategy not in STRATEGIES:
        raise _bad(
            where, f"routing.strategy {r.strategy!r} is unknown; use {', '.join(STRATEGIES)}"
        )
    lo, hi = PREFIX_LENGTH_RANGE
    if r.prefix_length < lo:
        raise _bad(
            where,
            f"routing.prefix_length {r.prefix_length} is below {lo}; use {lo}..{hi} characters",
        )
    if r.prefix_length > hi:
        raise _bad(
            where,
            f"routing.prefix_length {r.prefix_length} is above {hi}; use {lo}..{hi} characters",
        )
    clo, chi = CONCURRENCY_RANGE
    if not clo <= r.concurrency_threshold <= chi:
        raise _bad(
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
                    raise _bad(
                        where,
                        "modelCacheConfig.weights.nodes has both names and selector; use one",
                    )
                selector = NodeSelector(
                    names=tuple(w.nodes.names), labels=tuple(sorted(w.nodes.selector.items()))
                )
            else:
                selector = NodeSelector()
            if w.min_ready is not None and w.min_ready < 0:
                raise _bad(
                    where,
                    f"modelCacheConfig.weights.minReady {w.min_ready} is negative; "
                    "use 0 (do not wait) or a node count",
                )
            if selector.names and w.min_ready is not None and w.min_ready > len(selector.names):
                raise _bad(
                    where,
                    f"modelCacheConfig.weights.minReady {w.min_ready} is above the "
                    f"{len(selector.names)} listed nodes; lower it or list more nodes",
                )
            if w.timeout_seconds <= 0:
                raise _bad(
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
        cache = ModelCacheConfig(weights=weights, image=image)

    autoscaling = None
    if raw.autoscaling is not None:
        a = raw.autoscaling
        below = a.scale_in_below if a.scale_in_below is not None else a.target_in_flight / 2
        if below >= a.target_in_flight:
            raise _bad(
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
        raise ConfigError(_pydantic_message(where, exc)) from None
    return _convert_endpoint(raw)


def _read_yaml(path: Path, what: str) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {exc}") from None


def load_endpoint(path: str | Path) -> EndpointSpec:
    """Read and validate an endpoint spec file."""
    p = Path(path)
    return parse_endpoint(_read_yaml(p, "endpoint spec"), origin=f"endpoint spec {str(p)!r}")


def _bandwidth(where: str, loc: str, value: str | int | None) -> int | None:
    if value is None:
        return None
    text = value if isinstance(value, int) else value.strip().removesuffix("/s")
    n = parse_size(text, what=f"{where}: {loc}")
    if n <= 0:
        raise _bad(where, f"{loc} {value!r} must be above 0; write it like 50MiB/s")
    return n


def parse_cluster(data: Any, *, base_dir: Path, origin: str = "cluster file") -> ClusterSpec:
    """Validate a cluster document; relative store paths are taken from ``base_dir``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping with 'nodes', got {type(data).__name__}")
    try:
        raw = _Cluster.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_pydantic_message(origin, exc)) from None
    if not raw.nodes:
        raise _bad(origin, "nodes is empty; list at least one node")
    default_bw = _bandwidth(origin, "origin.bandwidth", raw.origin.bandwidth)
    nodes: list[NodeSpec] = []
    seen: set[str] = set()
    for i, n in enumerate(raw.nodes):
        loc = f"nodes[{i}]"
        _check_name(origin, f"{loc}.name", n.name)
        if n.name in seen:
            raise _bad(origin, f"{loc}.name {n.name!r} is used twice; node names are unique")
        seen.add(n.name)
        if n.slots < 1:
            raise _bad(origin, f"{loc}.slots {n.slots} must be at least 1 (replicas per node)")
        capacity = parse_size(n.capacity, what=f"{origin}: {loc}.capacity")
        if capacity <= 0:
            raise _bad(origin, f"{loc}.capacity must be above 0; write it like 20GiB")
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
    return ClusterSpec(nodes=tuple(nodes), origin=OriginSpec(bandwidth=default_bw))


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster file; store paths are relative to the file."""
    p = Path(path)
    return parse_cluster(
        _read_yaml(p, "cluster file"),
        base_dir=p.resolve().parent,
        origin=f"cluster file {str(p)!r}",
    )


def default_cluster(state_dir: Path, *, capacity: int, nodes: int = 1) -> ClusterSpec:
    """The cluster ``preheat up`` uses without ``--cluster``: local nodes under the state dir."""
    return ClusterSpec(
        nodes=tuple(
            NodeSpec(name=f"local-{i}", store=state_dir / "nodes" / f"local-{i}", capacity=capacity)
            for i in range(nodes)
        )
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
            raise _bad(
                where,
                f"modelCacheConfig.weights.nodes names {name!r}, which is not in the cluster "
                f"({', '.join(sorted(names))}); fix the name or add the node",
            )
    targets = [n for n in cluster.nodes if w.nodes.matches(n.name, n.label_map)]
    if not targets:
        raise _bad(
            where,
            f"modelCacheConfig.weights.nodes selects no node ({w.nodes.describe()}); "
            "fix the selector or label some nodes",
        )
    if w.min_ready is not None and w.min_ready > len(targets):
        raise _bad(
            where,
            f"modelCacheConfig.weights.minReady {w.min_ready} is above the {len(targets)} "
            f"target nodes ({w.nodes.describe()}); lower it or target more nodes",
        )
