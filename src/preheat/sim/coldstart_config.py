"""What a cold-start simulation is given: fleet, models, start-up costs, scaling, traffic.

Pure: frozen values plus validation of already-parsed data (the YAML is read by
``coldstart_files``). Every error is a ``ConfigError`` naming the bad value and the fix.

The models file::

    models:                        # 1..200 models, names unique
      - name: llama-70b
        size: 141GB                # bytes on disk (sizes like 15GB, 3.5TB, 600GiB)
        popularity: 5              # relative share of the traffic (> 0) ...
        priority: 10               # eviction priority (higher stays longer; default 0)
        pin: false                 # cache policy "priority": warmed everywhere, never evicted
        min_replicas: 1            # autoscaler bounds (default max: twice the model's
                                   # popularity share of the fleet's slots, at least 2)
        max_replicas: 40
        profile: llama-3.1-70b-8xh100   # timing profile for the first response
    zipf: 1.0                      # ... or no popularity anywhere and rank-based Zipf(s)
    startup:                       # per start, after the weights are on the node
      runtime_seconds: 20          # container + engine process up
      load_bandwidth: 4GB/s        # NVMe -> GPU memory
      warmup_seconds: 30           # CUDA graphs, first compile
    autoscaling:                   # control.autoscale's rule (spec: autoscaling)
      target_in_flight: 16
      scale_in_below: 8
      cooldown_seconds: 300
    traffic:                       # pattern parameters (sim/traffic.py)
      peak_utilization: 0.8
      trough: 0.25
    cache:
      gate_timeout_seconds: 600    # modelCacheConfig.weights.timeoutSeconds
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from preheat.config import parse_size
from preheat.control.spec_types import Autoscaling
from preheat.errors import ConfigError
from preheat.timing import PROFILES

__all__ = [
    "CACHE_POLICIES",
    "Catalog",
    "ModelSpec",
    "Startup",
    "TrafficParams",
    "catalog_from_dict",
    "parse_bandwidth",
    "parse_duration",
]

#: ``--cache-policy`` names, in the order the study compares them.
CACHE_POLICIES = ("none", "warm-all", "lru", "priority", "predictive")

DEFAULT_PROFILE = "llama-3.1-70b-8xh100"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    size: int
    popularity: float
    priority: int = 0
    pin: bool = False
    min_replicas: int = 1
    max_replicas: int | None = None
    profile: str = DEFAULT_PROFILE

    @property
    def revision(self) -> str:
        """The immutable identity the simulator keys caches by (one revision per model)."""
        return f"rev-{self.name}"


@dataclass(frozen=True)
class Startup:
    """Costs of one replica start after its weights are on the node."""

    runtime_seconds: float = 20.0
    load_bandwidth: float = 4e9  # bytes/s from local NVMe into GPU memory
    warmup_seconds: float = 30.0
    #: Prompt tokens of the first request (its prefill comes from the timing profile).
    first_prompt_tokens: int = 1000
    #: A draining replica finishes its in-flight requests in this long, then stops.
    drain_seconds: float = 30.0


@dataclass(frozen=True)
class TrafficParams:
    """Shape of the synthetic patterns (see ``sim/traffic.py`` for their meaning)."""

    peak_utilization: float = 0.8
    trough: float = 0.25
    day_seconds: float = 86400.0
    noise: float = 0.05
    burst_every_seconds: float = 3 * 3600.0
    burst_seconds: float = 1800.0
    burst_base: float = 0.3
    spot_mtbi_seconds: float = 50 * 3600.0
    spot_replace_seconds: float = 180.0
    sample_seconds: float = 30.0


@dataclass(frozen=True)
class Catalog:
    """The parsed models file."""

    models: tuple[ModelSpec, ...]
    startup: Startup = field(default_factory=Startup)
    autoscaling: Autoscaling = field(
        default_factory=lambda: Autoscaling(
            target_in_flight=16.0, scale_in_below=8.0, cooldown_seconds=300.0
        )
    )
    traffic: TrafficParams = field(default_factory=TrafficParams)
    gate_timeout_seconds: float = 600.0

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def shares(self) -> dict[str, float]:
        total = sum(m.popularity for m in self.models)
        return {m.name: m.popularity / total for m in self.models}


# --- units --------------------------------------------------------------------------------

_BITS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(bps|bit/s|b/s)\s*$")
_BIT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*$")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_bandwidth(text: str | int | float, *, what: str = "bandwidth") -> float:
    """Bytes per second from ``10Gbps`` / ``400Mbit/s`` (bits) or ``1.25GB/s`` (bytes)."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} {text!r} is not a bandwidth; write it like 10Gbps or 1GB/s")
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _BITS.match(text)
        if m:
            value = float(m.group(1)) * _BIT_UNITS[m.group(2).lower()] / 8
        elif text.strip().endswith("/s"):
            value = float(parse_size(text.strip()[:-2], what=what))
        else:
            raise ConfigError(
                f"{what} {text!r} is not a bandwidth; write it like 10Gbps, 400Mbps or 1.25GB/s"
            )
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{what} {text!r} must be above zero, e.g. 10Gbps")
    return value


def parse_duration(text: str | int | float, *, what: str = "duration") -> float:
    """Seconds from ``3600``, ``90m``, ``24h`` or ``2d``."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise ConfigError(f"{what} {text!r} is not a duration; write it like 3600, 90m or 24h")
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{what} {text!r} must be above zero, e.g. 24h")
    return value


# --- the models file ----------------------------------------------------------------------

_MODEL_KEYS = {
    "name",
    "size",
    "popularity",
    "priority",
    "pin",
    "min_replicas",
    "max_replicas",
    "profile",
}
_TOP_KEYS = {"models", "zipf", "startup", "autoscaling", "traffic", "cache"}
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$")


def _unknown(where: str, data: Mapping[str, Any], known: set[str]) -> None:
    extra = sorted(set(data) - known)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {extra}; known: {', '.join(sorted(known))}")


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _number(where: str, value: Any, *, minimum: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where} = {value!r} is not a number")
    if value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise ConfigError(f"{where} = {value!r}; it must be {op} {minimum:g}")
    return float(value)


def _int(where: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where} = {value!r}; give a whole number >= {minimum}")
    return value


def _model(i: int, data: Any, zipf_weight: float | None) -> ModelSpec:
    where = f"models[{i}]"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping with name and size, got {data!r}")
    _unknown(where, data, _MODEL_KEYS)
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"{where}.name = {name!r}; use lowercase letters, digits, '.', '_' or '-' "
            "(at most 64 characters)"
        )
    where = f"model {name!r}"
    if "size" not in data:
        raise ConfigError(f"{where} has no size; add e.g. size: 140GB")
    size = parse_size(data["size"], what=f"{where} size")
    if size <= 0:
        raise ConfigError(f"{where} size {data['size']!r} must be above zero")
    if "popularity" in data:
        if zipf_weight is not None:
            raise ConfigError(
                f"{where} sets popularity while the file sets zipf; use one or the other"
            )
        popularity = _number(f"{where} popularity", data["popularity"])
    elif zipf_weight is not None:
        popularity = zipf_weight
    else:
        raise ConfigError(f"{where} has no popularity; add popularity: 1 or a top-level zipf: 1.0")
    profile = data.get("profile", DEFAULT_PROFILE)
    if profile not in PROFILES:
        raise ConfigError(
            f"{where} profile {profile!r} is unknown; choose one of {', '.join(sorted(PROFILES))}"
        )
    pin = data.get("pin", False)
    if not isinstance(pin, bool):
        raise ConfigError(f"{where} pin = {pin!r}; write true or false")
    lo = _int(f"{where} min_replicas", data.get("min_replicas", 1), minimum=0)
    hi_raw = data.get("max_replicas")
    hi = None if hi_raw is None else _int(f"{where} max_replicas", hi_raw, minimum=max(lo, 1))
    return ModelSpec(
        name=name,
        size=size,
        popularity=popularity,
        priority=_int(f"{where} priority", data.get("priority", 0), minimum=-(10**6)),
        pin=pin,
        min_replicas=lo,
        max_replicas=hi,
        profile=profile,
    )


def _startup(data: Mapping[str, Any]) -> Startup:
    d = Startup()
    _unknown(
        "startup",
        data,
        {
            "runtime_seconds",
            "load_bandwidth",
            "warmup_seconds",
            "first_prompt_tokens",
            "drain_seconds",
        },
    )
    return Startup(
        runtime_seconds=_number(
            "startup.runtime_seconds", data.get("runtime_seconds", d.runtime_seconds), strict=False
        ),
        load_bandwidth=parse_bandwidth(
            data.get("load_bandwidth", d.load_bandwidth), what="startup.load_bandwidth"
        ),
        warmup_seconds=_number(
            "startup.warmup_seconds", data.get("warmup_seconds", d.warmup_seconds), strict=False
        ),
        first_prompt_tokens=_int(
            "startup.first_prompt_tokens",
            data.get("first_prompt_tokens", d.first_prompt_tokens),
            minimum=1,
        ),
        drain_seconds=_number(
            "startup.drain_seconds", data.get("drain_seconds", d.drain_seconds), strict=False
        ),
    )


def _autoscaling(data: Mapping[str, Any], default: Autoscaling) -> Autoscaling:
    _unknown("autoscaling", data, {"target_in_flight", "scale_in_below", "cooldown_seconds"})
    target = _number(
        "autoscaling.target_in_flight", data.get("target_in_flight", default.target_in_flight)
    )
    below = _number(
        "autoscaling.scale_in_below",
        data.get("scale_in_below", min(default.scale_in_below, target / 2)),
        strict=False,
    )
    if below >= target:
        raise ConfigError(
            f"autoscaling.scale_in_below {below:g} must be below target_in_flight {target:g}"
        )
    cooldown = _number(
        "autoscaling.cooldown_seconds",
        data.get("cooldown_seconds", default.cooldown_seconds),
        strict=False,
    )
    return Autoscaling(target_in_flight=target, scale_in_below=below, cooldown_seconds=cooldown)


def _traffic(data: Mapping[str, Any]) -> TrafficParams:
    d = TrafficParams()
    known = set(TrafficParams.__dataclass_fields__)
    _unknown("traffic", data, known)
    values: dict[str, float] = {}
    for key in known:
        if key in data:
            raw = data[key]
            if key.endswith("_seconds"):
                values[key] = parse_duration(raw, what=f"traffic.{key}")
            else:
                values[key] = _number(f"traffic.{key}", raw, strict=False)
    out = TrafficParams(**{**{k: getattr(d, k) for k in known}, **values})
    for key in ("peak_utilization", "trough", "burst_base"):
        if not 0 < getattr(out, key) <= 1.5:
            raise ConfigError(f"traffic.{key} = {getattr(out, key)!r}; give a fraction in (0, 1.5]")
    return out


def catalog_from_dict(data: Any) -> Catalog:
    """Validate a parsed models file (see the module docstring for its shape)."""
    if not isinstance(data, Mapping):
        raise ConfigError("the models file must be a mapping with a 'models:' list")
    _unknown("models file", data, _TOP_KEYS)
    raw = data.get("models")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("the models file needs a non-empty 'models:' list")
    if len(raw) > 200:
        raise ConfigError(f"the models file lists {len(raw)} models; at most 200 are simulated")
    zipf = data.get("zipf")
    s = None if zipf is None else _number("zipf", zipf, strict=False)
    models = tuple(
        _model(i, m, None if s is None else 1.0 / (i + 1) ** s) for i, m in enumerate(raw)
    )
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"model name(s) {dupes} appear more than once; names must be unique")
    cache = _mapping("cache", data.get("cache"))
    _unknown("cache", cache, {"gate_timeout_seconds"})
    default = Catalog(models=models)
    return Catalog(
        models=models,
        startup=_startup(_mapping("startup", data.get("startup"))),
        autoscaling=_autoscaling(
            _mapping("autoscaling", data.get("autoscaling")), default.autoscaling
        ),
        traffic=_traffic(_mapping("traffic", data.get("traffic"))),
        gate_timeout_seconds=parse_duration(
            cache.get("gate_timeout_seconds", default.gate_timeout_seconds),
            what="cache.gate_timeout_seconds",
        ),
    )
