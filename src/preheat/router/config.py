"""The router's configuration: parsed and validated once at the edge (file, CLI, admin API).

File format (YAML or JSON; see docs/routing.md)::

    variants:
      - name: default               # [a-zA-Z0-9_.-]{1,64}
        weight: 1.0                 # share of traffic among variants (>= 0)
        strategy: prefix_aware      # random | least_outstanding | prefix_aware
        prefix_length: 8192         # characters, 1024-65536
        concurrency_threshold: 64   # in-flight per instance, 1-1024
        balance_epsilon: 0.1        # (1+eps) x mean in-flight bound, 0.01-10
        block_chars: 2048           # hashed block size, 512-16384
        index_entries: 200000       # learned block hashes kept (memory bound)
        max_holders: 8              # instances remembered per learned block
        balance_window: 1000        # decisions over which request shares are balanced
        load_weight: 0.05           # queued prefill vs this prompt's uncached prefill
        placement: stable-move      # stable-move (default) | stable | stable-split | learned
                                    # | hash (stateless) | hybrid
        instances: [http://127.0.0.1:8001, http://127.0.0.1:8002]
    # or, with the instance's KV-event publisher (router/kvevents_sub.py; the options of a
    # real model's engine, tokenizer/hash/replay, are in router/kvspec.py):
    #   - {url: http://127.0.0.1:8001, kv_events: tcp://127.0.0.1:5557}
    kv_events_silence_s: 5.0        # owed KV events missing this long -> learned fallback
    kv_events_options: {}           # tokenizer/hash/hash_seed/block_size for every instance's
                                    # kv_events (its own fields win; router/kvspec.py)
    upstream_timeout_s: 300         # no byte from the instance for this long -> 504
    connect_timeout_s: 5
    max_body_bytes: 8388608         # larger request bodies -> 413
    health: {interval_s: 2.0, timeout_s: 1.0, failures: 2, path: /health}

Instances may be given as URL strings or as ``{url: ..., kv_events: ...}`` objects (what
``GET /admin/config`` returns, so a config read from the API can be PUT back).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from preheat.errors import ConfigError
from preheat.router.policies import POLICIES, PolicyParams

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The routing parameters, their defaults and their bounds are PolicyParams' own (it
# validates itself); this module only names them and checks their JSON types.
PARAM_KEYS = tuple(f.name for f in fields(PolicyParams))
_PARAM_TYPES = {f.name: str(f.type) for f in fields(PolicyParams)}
_VARIANT_KEYS = {"name", "weight", "strategy", "instances", *PARAM_KEYS}
# Bounds of the numeric fields outside PolicyParams: (low, high, integer). The defaults
# are the dataclass defaults below; nothing else repeats them.
_TOP_BOUNDS = {
    "upstream_timeout_s": (0.05, 86400, False),
    "connect_timeout_s": (0.05, 600, False),
    "max_body_bytes": (1024, 1 << 30, True),
    "kv_events_silence_s": (0.1, 3600, False),
}
_HEALTH_BOUNDS = {
    "interval_s": (0.05, 3600, False),
    "timeout_s": (0.05, 600, False),
    "failures": (1, 100, True),
}
_WEIGHT_BOUNDS = (0, 1e6)
_TOP_KEYS = {"variants", "health", "kv_events_options", *_TOP_BOUNDS}
_HEALTH_KEYS = {"path", *_HEALTH_BOUNDS}
PATCHABLE = (
    "strategy",
    "prefix_length",
    "concurrency_threshold",
    "weight",
    "balance_epsilon",
    "balance_window",
    "load_weight",
    "placement",
)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Active health checks: GET ``path`` on every instance each ``interval_s`` seconds;
    ``failures`` consecutive failures mark it unhealthy, one success marks it healthy."""

    interval_s: float = 2.0
    timeout_s: float = 1.0
    failures: int = 2
    path: str = "/health"


@dataclass(frozen=True, slots=True)
class VariantConfig:
    """A named group of instances with a traffic weight and one routing strategy."""

    name: str
    strategy: str = "random"
    weight: float = 1.0
    params: PolicyParams = field(default_factory=PolicyParams)
    instances: tuple[str, ...] = ()
    # (instance URL, its KV-event endpoint tcp://host:port) for instances that publish.
    kv_events: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        p = self.params
        ev = dict(self.kv_events)
        return {
            "name": self.name,
            "weight": self.weight,
            "strategy": self.strategy,
            **{k: getattr(p, k) for k in PARAM_KEYS},
            "instances": [{"url": u, "kv_events": ev[u]} if u in ev else u for u in self.instances],
        }


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The whole router configuration."""

    variants: tuple[VariantConfig, ...]
    upstream_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    kv_events_silence_s: float = 5.0
    health: HealthConfig = field(default_factory=HealthConfig)
    # How every instance's engine hashes prompts, unless its own kv_events says otherwise
    # (router/kvspec.py OPTION_KEYS); already applied to the variants' kv_events.
    kv_events_options: tuple[tuple[str, str], ...] = ()

    def variant(self, name: str) -> VariantConfig:
        for v in self.variants:
            if v.name == name:
                return v
        raise ConfigError(
            f"variant {name!r} does not exist; known: {', '.join(v.name for v in self.variants)}"
        )

    def with_variant(self, new: VariantConfig) -> RouterConfig:
        return replace(
            self, variants=tuple(new if v.name == new.name else v for v in self.variants)
        )

    def to_dict(self) -> dict[str, Any]:
        h = self.health
        return {
            "variants": [v.to_dict() for v in self.variants],
            "upstream_timeout_s": self.upstream_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "max_body_bytes": self.max_body_bytes,
            "kv_events_silence_s": self.kv_events_silence_s,
            "kv_events_options": dict(self.kv_events_options),
            "health": {
                "interval_s": h.interval_s,
                "timeout_s": h.timeout_s,
                "failures": h.failures,
                "path": h.path,
            },
        }


# Fields read once when the router starts (the HTTP server's body limit): a change through
# ``PUT /admin/config`` is refused with the reason. Everything else applies live.
RESTART_ONLY = ("max_body_bytes",)


def restart_only_changes(old: RouterConfig, new: RouterConfig) -> list[str]:
    """``"field old -> new"`` for each restart-only field that differs."""
    return [
        f"{name} {getattr(old, name)} -> {getattr(new, name)}"
        for name in RESTART_ONLY
        if getattr(old, name) != getattr(new, name)
    ]


def check_url(url: Any, *, where: str) -> str:
    """An instance URL: http(s)://host:port with no path, normalised without a trailing '/'."""
    if not isinstance(url, str):
        raise ConfigError(f"{where}: instance {url!r} is not a URL string like http://host:8000")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: instance {url!r} is not an http(s)://host:port URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{where}: instance {url!r} must not have a path; give http://host:port")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"{where}: instance {url!r} has a bad port") from exc
    return url.rstrip("/")


def _number(value: Any, where: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where} {value!r} is not {kind}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where} {value} is outside {lo:g}-{hi:g}")
    return value


def parse_variant(
    data: Any, *, where: str = "variant", kv_options: Mapping[str, str] | None = None
) -> VariantConfig:
    """Validate one variant mapping; errors name the variant and the field.
    ``kv_options`` (``kv_events_options``) fill the instances' ``kv_events`` fields."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping with at least a 'name'")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: name {name!r} must match [A-Za-z0-9_.-]{{1,64}}")
    where = f"variant {name!r}"
    unknown = set(data) - _VARIANT_KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(_VARIANT_KEYS))}"
        )
    strategy = data.get("strategy", _default(VariantConfig, "strategy"))
    if strategy not in POLICIES:
        raise ConfigError(
            f"{where}: strategy {strategy!r} is unknown; choose one of {', '.join(POLICIES)}"
        )
    weight = float(
        _number(
            data.get("weight", _default(VariantConfig, "weight")),
            f"{where}: weight",
            *_WEIGHT_BOUNDS,
        )
    )
    kwargs = {k: data[k] for k in PARAM_KEYS if k in data}
    for k, v in kwargs.items():
        kind = _PARAM_TYPES[k]
        if kind == "str":
            if not isinstance(v, str):
                raise ConfigError(f"{where}: {k} {v!r} is not a string")
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(f"{where}: {k} {v!r} is not a number")
        if kind == "int" and not isinstance(v, int):
            raise ConfigError(f"{where}: {k} {v!r} must be an integer")
    try:
        params = PolicyParams(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    raw = data.get("instances", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: instances must be a list of URLs")
    urls = []
    events: list[tuple[str, str]] = []
    for item in raw:
        url = check_url(item.get("url") if isinstance(item, Mapping) else item, where=where)
        urls.append(url)
        ev = item.get("kv_events") if isinstance(item, Mapping) else None
        if ev is not None:
            events.append(
                (url, check_kv_events(ev, where=f"{where}: instance {url}", options=kv_options))
            )
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{where}: an instance is listed twice")
    return VariantConfig(
        name=name,
        strategy=strategy,
        weight=weight,
        params=params,
        instances=tuple(urls),
        kv_events=tuple(events),
    )


def check_kv_events(endpoint: Any, *, where: str, options: Mapping[str, str] | None = None) -> str:
    """A KV-event setting (router/kvspec.py: ``tcp://host:port`` as vLLM binds it, or a
    mapping with endpoint, replay, tokenizer, hash, hash_seed, block_size), as one string;
    ``options`` (``kv_events_options``) fill the fields it leaves out."""
    from preheat.router.kvspec import parse_kv_events

    return parse_kv_events(endpoint, where=where, options=options).canonical(options or ())


def check_kv_events_options(value: Any, *, where: str = "kv_events_options") -> dict[str, str]:
    """``kv_events_options`` checked (router/kvspec.py ``parse_kv_events_options``)."""
    from preheat.router.kvspec import parse_kv_events_options

    return parse_kv_events_options(value, where=where)


def with_kv_events(config: RouterConfig, endpoints: Mapping[str, str]) -> RouterConfig:
    """``config`` with KV-event endpoints added to the named instances (``--kv-events``,
    the config's ``kv_events_options`` applied); an instance URL in no variant is an
    error that lists the known ones."""
    known = {u: v.name for v in config.variants for u in v.instances}
    for url in endpoints:
        if url not in known:
            raise ConfigError(
                f"--kv-events names instance {url}, which no variant has; "
                f"known: {', '.join(sorted(known)) or 'none'}"
            )
    out = []
    for v in config.variants:
        opts = dict(config.kv_events_options)
        given = {
            u: check_kv_events(e, where=f"--kv-events {u}", options=opts)
            for u, e in endpoints.items()
            if known[u] == v.name
        }
        ev = dict(v.kv_events) | given
        out.append(replace(v, kv_events=tuple((u, ev[u]) for u in v.instances if u in ev)))
    return replace(config, variants=tuple(out))


def parse_config(data: Any) -> RouterConfig:
    """Validate a whole config mapping (from a file or ``PUT /admin/config``)."""
    if not isinstance(data, Mapping):
        raise ConfigError("the router config must be a mapping with a 'variants' list")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(
            f"unknown config field(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(_TOP_KEYS))}"
        )
    raw = data.get("variants")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("the router config needs a non-empty 'variants' list")
    kv_options = check_kv_events_options(data.get("kv_events_options") or {})
    variants = tuple(
        parse_variant(v, where=f"variants[{i}]", kv_options=kv_options) for i, v in enumerate(raw)
    )
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ConfigError(f"variant names must be unique; got {names}")
    seen: dict[str, str] = {}
    for v in variants:
        for url in v.instances:
            if url in seen:
                raise ConfigError(f"instance {url} is in both {seen[url]!r} and {v.name!r}")
            seen[url] = v.name
    health_raw = data.get("health", {})
    if not isinstance(health_raw, Mapping) or set(health_raw) - _HEALTH_KEYS:
        raise ConfigError(f"health must be a mapping of {', '.join(sorted(_HEALTH_KEYS))}")
    health = HealthConfig(
        **_numbers(health_raw, HealthConfig, _HEALTH_BOUNDS, "health."),
        path=_health_path(health_raw.get("path", _default(HealthConfig, "path"))),
    )
    return RouterConfig(
        variants=variants,
        health=health,
        kv_events_options=tuple(kv_options.items()),
        **_numbers(data, RouterConfig, _TOP_BOUNDS, ""),
    )


def _default(cls: type, name: str) -> Any:
    """The dataclass default of ``cls.name`` (the one place a default is written)."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
    raise KeyError(name)


def _numbers(
    data: Mapping[str, Any],
    cls: type,
    bounds: Mapping[str, tuple[float, float, bool]],
    prefix: str,
) -> dict[str, Any]:
    """Each bounded numeric field of ``cls`` from ``data`` (or its default), checked."""
    out: dict[str, Any] = {}
    for name, (lo, hi, integer) in bounds.items():
        v = _number(data.get(name, _default(cls, name)), prefix + name, lo, hi, integer=integer)
        out[name] = v if integer else float(v)
    return out


def _health_path(value: Any) -> str:
    # The path is appended to each instance URL: anything but a plain absolute path
    # (e.g. "@other-host/x") would send the probes somewhere else.
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or value.startswith("//")
        or any(c in value for c in " @#?\\")
        or not value.isprintable()
        or len(value) > 256
    ):
        raise ConfigError(f"health.path {value!r} must be an absolute path like /health")
    return value


def load_config(path: str | Path) -> RouterConfig:
    """Read a YAML or JSON config file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read router config {p}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"router config {p} is not valid YAML/JSON: {exc}") from exc
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def patch_variant(variant: VariantConfig, patch: Any) -> VariantConfig:
    """Apply ``PATCH /admin/variants/{name}`` fields; unknown fields are an error."""
    if not isinstance(patch, Mapping) or not patch:
        raise ConfigError(f"a variant patch is a non-empty object of {', '.join(PATCHABLE)}")
    unknown = set(patch) - set(PATCHABLE)
    if unknown:
        raise ConfigError(
            f"cannot patch {', '.join(sorted(unknown))}; patchable: {', '.join(PATCHABLE)}"
        )
    merged = variant.to_dict() | dict(patch)
    return parse_variant(merged, where=f"variant {variant.name!r}")
