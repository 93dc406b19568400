"""Start records: one replica start as a frozen, validated value (pure: no I/O, no clock).

A ``StartRecord`` is one replica start: a wall-clock timestamp (epoch seconds) at each
stage boundary

    scheduled -> image_ready -> weights_ready -> runtime_started -> weights_loaded
              -> healthy -> first_response

plus the labels that explain it: where the image and the weights came from, how many
bytes were read from each weights source, and the event class (why this start happened,
see ``preheat.telemetry.classify``). A boundary that was not reached (a failed start, or
an engine that does not report ``weights_loaded``) is ``None``.

Stage durations are differences of consecutive *present* timestamps: the time between
the previous boundary that was recorded and this one is charged to this stage (see
``StartRecord.stage_durations``). So a start with no ``weights_loaded`` charges the whole
load to the ``healthy`` stage instead of inventing a split.

Records encode to and decode from one JSON object (``to_json``, ``from_dict``); writing
and reading files is ``preheat.telemetry.events``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

__all__ = [
    "IMAGE_SOURCES",
    "SCHEMA_VERSION",
    "STAGES",
    "STAGE_BOUNDARIES",
    "WEIGHTS_SOURCES",
    "EventClass",
    "StartRecord",
    "WarmupRecord",
]

#: Stage boundaries in the order a start passes them.
STAGE_BOUNDARIES: tuple[str, ...] = (
    "scheduled",
    "image_ready",
    "weights_ready",
    "runtime_started",
    "weights_loaded",
    "healthy",
    "first_response",
)
#: Stages, named after the boundary that ends them (``scheduled`` only starts the clock).
STAGES: tuple[str, ...] = STAGE_BOUNDARIES[1:]

IMAGE_SOURCES: tuple[str, ...] = ("cache", "pull")
WEIGHTS_SOURCES: tuple[str, ...] = ("cache", "peer", "origin")

SCHEMA_VERSION = 1


class EventClass(StrEnum):
    """Why a replica started; the unit of every percentile in a report."""

    WARM_RESTART = "warm_restart"
    COLD_POD_WARM_NODE = "cold_pod_warm_node"
    NEW_NODE = "new_node"
    NEW_VERSION = "new_version"
    NODE_LOSS_RECOVERY = "node_loss_recovery"
    SCALE_OUT = "scale_out"


def _check_ts(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"StartRecord.{name} = {value!r} is not a finite epoch time in seconds")


def _check_bytes_from(record: str, bytes_from: Mapping[str, int]) -> None:
    """``bytes_from`` maps a weights source (cache, peer, origin) to bytes >= 0."""
    for source, n in bytes_from.items():
        if source not in WEIGHTS_SOURCES:
            raise ValueError(
                f"{record}.bytes_from has source {source!r}; use cache, peer or origin"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{record}.bytes_from[{source!r}] = {n!r}; give bytes >= 0")


@dataclass(frozen=True, slots=True)
class WarmupRecord:
    """One finished warm-up of a revision on a node: how long it took (from the warm-up's
    start, any wait for a seed or an origin slot included) and where its bytes came from."""

    node: str
    revision: str
    seconds: float
    #: ``origin`` (it took an origin slot), ``peer`` (every blob from peers) or ``cache``.
    mode: str
    bytes_from: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.node or not self.revision:
            raise ValueError("WarmupRecord needs a node and a revision")
        if not math.isfinite(self.seconds) or self.seconds < 0:
            raise ValueError(f"WarmupRecord.seconds = {self.seconds!r}; give seconds >= 0")
        if self.mode not in WEIGHTS_SOURCES:
            raise ValueError(f"WarmupRecord.mode = {self.mode!r}; use cache, peer or origin")
        _check_bytes_from("WarmupRecord", self.bytes_from)
        object.__setattr__(self, "bytes_from", dict(self.bytes_from))

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "revision": self.revision,
            "seconds": round(self.seconds, 3),
            "mode": self.mode,
            "bytes_from": dict(self.bytes_from),
        }


@dataclass(frozen=True, slots=True)
class StartRecord:
    """One replica start, stage by stage. Times are wall-clock epoch seconds."""

    endpoint: str
    variant: str
    replica: str
    node: str
    revision: str
    event_class: EventClass
    scheduled: float
    image_ready: float | None = None
    weights_ready: float | None = None
    runtime_started: float | None = None
    weights_loaded: float | None = None
    healthy: float | None = None
    first_response: float | None = None
    #: ``cache`` (image present on the node) or ``pull``; ``None`` when no image is used.
    image_source: str | None = None
    #: ``cache`` (snapshot already on the node), ``peer`` or ``origin``.
    weights_source: str = "cache"
    #: Bytes of weights read per source during this start, e.g. ``{"origin": 4_000_000}``.
    bytes_from: Mapping[str, int] = field(default_factory=dict)
    #: How many times this replica slot had been restarted before this start.
    restart_count: int = 0
    #: Why the start failed, when it never became healthy; ``None`` for a good start.
    failure: str | None = None

    def __post_init__(self) -> None:
        for name in ("endpoint", "variant", "replica", "node", "revision"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"StartRecord.{name} = {value!r}; give a non-empty string")
        if not isinstance(self.event_class, EventClass):
            try:
                object.__setattr__(self, "event_class", EventClass(self.event_class))
            except ValueError:
                raise ValueError(
                    f"StartRecord.event_class = {self.event_class!r}; "
                    f"use one of {', '.join(c.value for c in EventClass)}"
                ) from None
        previous: tuple[str, float] | None = None
        for name in STAGE_BOUNDARIES:
            value = getattr(self, name)
            _check_ts(name, value)
            if name == "scheduled" and value is None:
                raise ValueError("StartRecord.scheduled is required: every start is scheduled")
            if value is None:
                continue
            value = float(value)
            object.__setattr__(self, name, value)
            if previous is not None and value < previous[1]:
                raise ValueError(
                    f"StartRecord.{name} = {value} is before {previous[0]} = {previous[1]}; "
                    "stage boundaries must not go back in time"
                )
            previous = (name, float(value))
        if self.image_source is not None and self.image_source not in IMAGE_SOURCES:
            raise ValueError(
                f"StartRecord.image_source = {self.image_source!r}; use cache, pull or None"
            )
        if self.weights_source not in WEIGHTS_SOURCES:
            raise ValueError(
                f"StartRecord.weights_source = {self.weights_source!r}; use cache, peer or origin"
            )
        _check_bytes_from("StartRecord", self.bytes_from)
        if self.weights_source == "cache" and any(
            self.bytes_from.get(s, 0) for s in ("peer", "origin")
        ):
            raise ValueError(
                f"StartRecord.weights_source is 'cache' but bytes_from = {dict(self.bytes_from)} "
                "has remote bytes; label the start with the remote source (peer or origin)"
            )
        if self.restart_count < 0:
            raise ValueError(f"StartRecord.restart_count = {self.restart_count}; must be >= 0")
        # Freeze the mapping too: a record is a fact, not a cursor.
        object.__setattr__(self, "bytes_from", dict(self.bytes_from))

    # --- derived views ------------------------------------------------------------------

    def boundaries(self) -> dict[str, float]:
        """The stage boundaries that were reached, in order."""
        out: dict[str, float] = {}
        for name in STAGE_BOUNDARIES:
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value)
        return out

    def stage_durations(self) -> dict[str, float]:
        """Seconds per stage: each reached boundary minus the previous reached one."""
        out: dict[str, float] = {}
        prev: float | None = None
        for name, t in self.boundaries().items():
            if prev is not None:
                out[name] = t - prev
            prev = t
        return out

    @property
    def ready_seconds(self) -> float | None:
        """Scheduled to healthy: the time a replica takes to serve; ``None`` if never healthy."""
        return None if self.healthy is None else self.healthy - self.scheduled

    @property
    def ok(self) -> bool:
        """The start reached ``healthy`` and reported no failure."""
        return self.healthy is not None and self.failure is None

    @property
    def cache_hit(self) -> bool:
        """The weights were on the node already (no byte came from a peer or the origin)."""
        return self.weights_source == "cache"

    # --- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": SCHEMA_VERSION}
        for f in fields(self):
            name = f.name
            value = getattr(self, name)
            if name == "event_class":
                value = value.value
            elif name == "bytes_from":
                value = dict(value)
            out[name] = value
        return out

    def to_json(self) -> str:
        """One line of JSON (no newline), keys in declaration order."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StartRecord:
        version = data.get("v", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"start record schema v={version!r} is not supported (this preheat reads "
                f"v={SCHEMA_VERSION}); upgrade preheat to read it"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"v"})
        if unknown:
            raise ValueError(f"start record has unknown keys {unknown}")
        kwargs = {k: v for k, v in data.items() if k != "v"}
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"start record is incomplete: {exc}") from None

    @classmethod
    def from_json(cls, line: str) -> StartRecord:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"a start record is a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)
