"""The cold-start simulator's models file, validated into a ``Catalog`` (pure).

Every error is a ``ConfigError`` naming the bad value and the fix. The file::


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
        image: vllm/vllm-openai:v0.6.3  # the serving image (models may share one) ...
        image_size: 9GB                 # ... and its size; without them no image is pulled
        releases:                  # new revisions during the run (a rollout each), in
          - {at: 8h}               # time order; size defaults to the previous revision's
          - {at: 30h, size: 150GB}
    zipf: 1.0                      # ... or no popularity anywhere and rank-based Zipf(s)
    startup:                       # per start, after the weights are on the node
      runtime_seconds: 20          # container + engine process up
      load_bandwidth: 4GB/s        # NVMe -> GPU memory
      warmup_seconds: 30           # CUDA graphs, first compile
      image_pull: concurrent       # concurrent with the weights download, or before it
      restart_seconds: 10          # a crashed engine process up again (container kept)
      page_cache_bandwidth: 20GB/s # weights re-read from the page cache after a crash
    autoscaling:                   # control.autoscale's rule (spec: autoscaling)
      target_in_flight: 16
      scale_in_below: 8
      cooldown_seconds: 300
    traffic:                       # pattern parameters (sim/traffic.py)
      peak_utilization: 0.8
      trough: 0.25
      replica_mtbf_seconds: 7d     # mean time between crashes of one ready replica (0: none)
    queue:                         # requests waiting while capacity is short
      request_seconds: 20          # a request's time in flight (arrivals = demand / this)
      max_queued: 256              # per model; arrivals beyond it are dropped
      replica_in_flight: 16        # what one ready replica serves (default target_in_flight)
    cache:
      gate_timeout_seconds: 600    # modelCacheConfig.weights.timeoutSeconds
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from preheat.config import parse_size
from preheat.control.spec_types import Autoscaling
from preheat.errors import ConfigError
from preheat.sim.coldstart_config import (
    DEFAULT_PROFILE,
    IMAGE_PULLS,
    Catalog,
    ModelSpec,
    QueueParams,
    Startup,
    TrafficParams,
    parse_bandwidth,
    parse_duration,
)
from preheat.sim.coldstart_releases import releases_from
from preheat.timing import PROFILES

__all__ = ["catalog_from_dict"]

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
    "image",
    "image_size",
    "releases",
}
_TOP_KEYS = {"models", "zipf", "startup", "autoscaling", "traffic", "cache", "queue"}
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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
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
    image = data.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise ConfigError(
            f"{where} image = {image!r}; give an image name like vllm/vllm-openai:v0.6.3"
        )
    if (image is None) != ("image_size" not in data):
        raise ConfigError(f"{where}: give image and image_size together, e.g. image_size: 9GB")
    image_size = 0 if image is None else parse_size(data["image_size"], what=f"{where} image_size")
    if image is not None and image_size <= 0:
        raise ConfigError(f"{where} image_size {data['image_size']!r} must be above zero")
    lo = _int(f"{where} min_replicas", data.get("min_replicas", 1), minimum=0)
    hi_raw = data.get("max_replicas")
    hi = None if hi_raw is None else _int(f"{where} max_replicas", hi_raw, minimum=max(lo, 1))
    releases = releases_from(where, data.get("releases"), size)
    return ModelSpec(
        name=name,
        size=size,
        releases=releases,
        popularity=popularity,
        priority=_int(f"{where} priority", data.get("priority", 0), minimum=-(10**6)),
        pin=pin,
        min_replicas=lo,
        max_replicas=hi,
        profile=profile,
        image=image,
        image_size=image_size,
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
            "image_pull",
            "restart_seconds",
            "page_cache_bandwidth",
        },
    )
    pull = data.get("image_pull", d.image_pull)
    if pull not in IMAGE_PULLS:
        raise ConfigError(f"startup.image_pull = {pull!r}; choose one of {', '.join(IMAGE_PULLS)}")
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
        image_pull=pull,
        restart_seconds=_number(
            "startup.restart_seconds", data.get("restart_seconds", d.restart_seconds), strict=False
        ),
        page_cache_bandwidth=parse_bandwidth(
            data.get("page_cache_bandwidth", d.page_cache_bandwidth),
            what="startup.page_cache_bandwidth",
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
            if key == "replica_mtbf_seconds" and raw == 0:
                values[key] = 0.0  # no crashes
            elif key.endswith("_seconds"):
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
    sizes: dict[str, int] = {}
    for m in models:
        if m.image is not None and sizes.setdefault(m.image, m.image_size) != m.image_size:
            raise ConfigError(
                f"image {m.image!r} has two sizes ({sizes[m.image]} and {m.image_size} bytes); "
                "models that share an image give it one image_size"
            )
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"model name(s) {dupes} appear more than once; names must be unique")
    cache = _mapping("cache", data.get("cache"))
    _unknown("cache", cache, {"gate_timeout_seconds"})
    default = Catalog(models=models)
    queue = _queue(_mapping("queue", data.get("queue")))
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
        queue=queue,
    )


def _queue(data: Mapping[str, Any]) -> QueueParams:
    d = QueueParams()
    _unknown("queue", data, {"request_seconds", "max_queued", "replica_in_flight"})
    per = data.get("replica_in_flight")
    return QueueParams(
        request_seconds=parse_duration(
            data.get("request_seconds", d.request_seconds), what="queue.request_seconds"
        ),
        max_queued=_int("queue.max_queued", data.get("max_queued", d.max_queued), minimum=0),
        replica_in_flight=None if per is None else _number("queue.replica_in_flight", per),
    )
