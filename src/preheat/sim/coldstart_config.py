"""What a cold-start simulation is given: fleet, models, start-up costs, scaling, traffic.

Pure: frozen values and the units they are written in (sizes, bandwidths, durations).
The models file that fills them is validated by ``coldstart_catalog`` (its shape is
there); the YAML is read by ``coldstart_files``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from preheat.config import parse_size
from preheat.control.spec_types import Autoscaling
from preheat.errors import ConfigError

__all__ = [
    "CACHE_POLICIES",
    "DEFAULT_PROFILE",
    "IMAGE_PULLS",
    "WARM_BUDGET",
    "Catalog",
    "ModelSpec",
    "QueueParams",
    "Release",
    "Startup",
    "TrafficParams",
    "model_of",
    "parse_bandwidth",
    "parse_duration",
    "parse_warm_budget",
    "warm_budget_for",
]

#: ``--cache-policy`` names, in the order the study compares them.
CACHE_POLICIES = ("none", "warm-all", "lru", "priority", "predictive")

#: ``--warm-budget`` by default: as many origin fills at once as fill the origin at node
#: speed (``warm_budget_for``); every origin fill counts, a replica's own included, so
#: warm-ups yield the origin to starts.
WARM_BUDGET = "auto"

DEFAULT_PROFILE = "llama-3.1-70b-8xh100"


@dataclass(frozen=True)
class Release:
    """A new revision of a model during the run: at ``at`` seconds its spec's revision
    changes (``size`` bytes on disk) and the planner rolls its replicas to it."""

    at: float
    size: int


#: Separates a model's name from its release number in a revision (not allowed in names).
_RELEASE_SEP = "@"


def model_of(revision: str) -> str:
    """The model a simulated revision belongs to (``rev-NAME`` or ``rev-NAME@K``)."""
    return revision.removeprefix("rev-").split(_RELEASE_SEP, 1)[0]


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
    #: The serving image and its bytes; ``None``: no image is modelled for this model.
    image: str | None = None
    image_size: int = 0
    #: New revisions during the run, in time order (``releases:`` in the models file).
    releases: tuple[Release, ...] = ()

    @property
    def revision(self) -> str:
        """The immutable identity the simulator keys caches by: the first revision."""
        return self.revision_at(0)

    def revision_at(self, release: int) -> str:
        """The revision after ``release`` releases (0: the one deployed at the start)."""
        return f"rev-{self.name}" if release == 0 else f"rev-{self.name}{_RELEASE_SEP}{release}"

    def size_at(self, release: int) -> int:
        return self.size if release == 0 else self.releases[release - 1].size


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
    #: ``concurrent``: a start that pulls its image downloads its weights at the same time
    #: (the node agent fetches weights while kubelet pulls); ``before``: the weights
    #: download waits for the image (weights fetched by a container of the pod).
    image_pull: str = "concurrent"
    #: A crashed replica's engine process up again in its kept container.
    restart_seconds: float = 10.0
    #: Bytes/s at which a restarted engine re-reads weights still in the page cache.
    page_cache_bandwidth: float = 20e9


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
    #: Mean seconds between crashes of one ready replica (a Poisson process over the
    #: fleet's slots); each crash is a restart in place. 0: no crashes.
    replica_mtbf_seconds: float = 7 * 86400.0


IMAGE_PULLS = ("concurrent", "before")


@dataclass(frozen=True)
class QueueParams:
    """Request queueing while ready capacity is short (see ``sim/coldstart_queue.py``)."""

    #: Mean seconds a request is in flight: arrivals/s = in-flight demand / this.
    request_seconds: float = 20.0
    #: Requests waiting per model at most; arrivals beyond are dropped.
    max_queued: int = 256
    #: In-flight requests one ready replica serves; ``None``: ``target_in_flight``.
    replica_in_flight: float | None = None


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
    queue: QueueParams = field(default_factory=QueueParams)

    @property
    def replica_in_flight(self) -> float:
        q = self.queue.replica_in_flight
        return self.autoscaling.target_in_flight if q is None else q

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
    if isinstance(text, (int, float)):
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
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise ConfigError(f"{what} {text!r} is not a duration; write it like 3600, 90m or 24h")
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{what} {text!r} must be above zero, e.g. 24h")
    return value


def warm_budget_for(origin_bandwidth: float, node_bandwidth: float) -> int:
    """``auto``: the origin fills that saturate the origin, each at its node's link
    speed (40 Gbps over 25 Gbps links: 2); at least 1."""
    return max(1, math.ceil(origin_bandwidth / node_bandwidth - 1e-9))


def parse_warm_budget(
    text: str | int | None, *, origin_bandwidth: float, node_bandwidth: float
) -> int | None:
    """``--warm-budget``: a number of origin fills at once (>= 1), ``auto`` (see
    ``warm_budget_for``) or ``all`` (every warm-up at once, no budget: ``None``)."""
    word = text.strip().lower() if isinstance(text, str) else text
    if word is None or word == "all":
        return None
    if word == "auto":
        return warm_budget_for(origin_bandwidth, node_bandwidth)
    try:
        value = int(text)  # type: ignore[arg-type]
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"--warm-budget {text!r} must be a number of fills at once (at least 1), "
            "'auto' (the default: enough to fill the origin at node speed) or 'all'"
        )
    return value
