"""The endpoint spec's and cluster file's pydantic models: the shape accepted at the edge.

They reject unknown keys and wrong types, and check what one field can check alone (a
source ref's scheme, a command's placeholders, a non-negative time scale);
``preheat.control.spec_schema`` converts them to frozen values with the cross-field
checks. The class names keep their leading underscore: pydantic names union members by
class in an error's location, and ``spec_errors.field_path`` drops those parts by that underscore.
"""

from __future__ import annotations

import re
import string

from pydantic import BaseModel, ConfigDict, Field, field_validator

from preheat.artifacts.refs import parse_ref
from preheat.control.spec_types import RoutingSpec
from preheat.errors import ConfigError

__all__ = [
    "_Autoscaling",
    "_Budget",
    "_CacheConfig",
    "_Cluster",
    "_Edge",
    "_Endpoint",
    "_Engine",
    "_Image",
    "_ImageRef",
    "_Model",
    "_ModelRef",
    "_Node",
    "_Nodes",
    "_Origin",
    "_Peers",
    "_Replicas",
    "_Routing",
    "_Simulated",
    "_Variant",
    "_Weights",
]

_COMMAND_FIELDS = {"snapshot", "port", "host", "model", "replica"}


class _Edge(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


def _check_source(v: str) -> str:
    if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", v):
        raise ValueError(
            f"{v!r} is not a source ref; use file:///dir, "
            "http(s)://.../preheat-manifest.json, s3://bucket/prefix, "
            "hf://ORG/NAME[@REVISION] or oci://registry/repo:tag"
        )
    try:
        parse_ref(v)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return v


class _ModelRef(_Edge):
    source: str
    revision: str | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        return _check_source(v)


class _Model(_ModelRef):
    #: Other allowed versions, used only while the main one is revoked.
    fallback: list[_ModelRef] = []


class _ImageRef(_Edge):
    """``image: {ref: REF, fallback: [REF, ...]}`` (``image: REF`` is the short form)."""

    ref: str
    #: Other allowed images, in order, used only while this one's digest is revoked.
    fallback: list[str] = []


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
    image: str | _ImageRef | None = None
    engine: _Engine | None = None
    replicas: _Replicas | None = None


class _Routing(_Edge):
    strategy: str = RoutingSpec.strategy
    prefix_length: int = Field(RoutingSpec.prefix_length, alias="prefixLength")
    concurrency_threshold: int = Field(
        RoutingSpec.concurrency_threshold, alias="concurrencyThreshold"
    )


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
    image: str | _ImageRef | None = None
    engine: _Engine | None = None
    replicas: _Replicas = Field(default_factory=_Replicas)
    autoscaling: _Autoscaling | None = None
    variants: list[_Variant] | None = None
    routing: _Routing | None = None
    model_cache_config: _CacheConfig | None = Field(None, alias="modelCacheConfig")


class _Budget(_Edge):
    concurrent_fills: int | None = Field(None, alias="concurrentFills")
    bandwidth: str | int | None = None


class _Origin(_Edge):
    bandwidth: str | int | None = None
    budget: _Budget = Field(default_factory=lambda: _Budget.model_validate({}))


class _Peers(_Edge):
    enabled: bool = True


class _Node(_Edge):
    name: str
    store: str | None = None
    capacity: str | int = "100GiB"
    labels: dict[str, str] = Field(default_factory=dict)
    slots: int = 2
    origin_bandwidth: str | int | None = Field(None, alias="originBandwidth")


class _Cluster(_Edge):
    origin: _Origin = Field(default_factory=_Origin)
    peers: _Peers = Field(default_factory=_Peers)
    nodes: list[_Node]
