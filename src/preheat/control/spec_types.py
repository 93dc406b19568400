"""The endpoint spec and the local cluster as frozen values (pure: no I/O, no parsing).

The planner, the placement and the autoscaler read these; ``preheat.control.spec_schema``
builds them from validated YAML or HTTP bodies, ``preheat.control.spec_files`` from files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from preheat.control.fanout import Budget
from preheat.errors import ConfigError
from preheat.router.policies.base import PolicyParams

if TYPE_CHECKING:
    from pathlib import Path
    from typing import TypeAlias

__all__ = [
    "Autoscaling",
    "ClusterSpec",
    "CommandEngine",
    "EndpointSpec",
    "EngineSpec",
    "ImageCacheSpec",
    "ModelCacheConfig",
    "ModelSpec",
    "NodeSelector",
    "NodeSpec",
    "OriginSpec",
    "PeerSpec",
    "ReplicaRange",
    "RoutingSpec",
    "SimulatedEngine",
    "VariantSpec",
    "WeightsCacheSpec",
]


@dataclass(frozen=True)
class ModelSpec:
    """Where the weights come from. ``revision``, when given, must match what the source
    resolves to (a manifest digest); otherwise the endpoint pins what it resolves at apply."""

    source: str
    revision: str | None = None
    #: Other allowed versions, in order of preference: used only while this one is
    #: revoked (``control.revocation``). Each is a source with an optional pinned revision.
    fallback: tuple[ModelSpec, ...] = ()


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


#: Quoted so that importing this module evaluates no ``X | Y`` of classes (Python 3.9,
#: which benchmarks/pypy.py runs the cold-start simulator on, cannot).
EngineSpec: TypeAlias = "SimulatedEngine | CommandEngine"


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
    #: ``image.fallback``: other allowed images, in order of preference, used only while
    #: ``image``'s digest is revoked (``control.revocation``).
    image_fallback: tuple[str, ...] = ()


#: The router's own defaults: a spec that leaves a routing field out gets what
#: ``preheat router serve`` would use (docs/routing.md), never a second opinion.
_ROUTER_DEFAULTS = PolicyParams()


@dataclass(frozen=True)
class RoutingSpec:
    """Router strategy for every variant of the endpoint; defaults are ``PolicyParams``'."""

    strategy: str = "random"
    prefix_length: int = _ROUTER_DEFAULTS.prefix_length
    concurrency_threshold: int = _ROUTER_DEFAULTS.concurrency_threshold


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
    #: The cluster-wide origin budget (``origin.budget``): origin fills at once (default
    #: one per revision) and origin bytes/s over all of them (default unlimited).
    budget: Budget = field(default_factory=Budget)


@dataclass(frozen=True)
class PeerSpec:
    """``peers``: nodes serve the blobs they hold to each other (docs/peers.md)."""

    #: On by default: warming N nodes with one revision fetches about one copy. A
    #: node's ``origin_bandwidth`` limits its downloads from peers too (one link).
    enabled: bool = True


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
    peers: PeerSpec = field(default_factory=PeerSpec)

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(
            f"cluster has no node {name!r}; known nodes: {', '.join(n.name for n in self.nodes)}"
        )
