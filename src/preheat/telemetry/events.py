"""Start records and a crash-safe JSONL log for them.

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

``EventLog`` appends records as JSON lines. Each record is one ``write(2)`` on a file
opened with ``O_APPEND``: no userspace buffer to lose, and concurrent writers (processes
or threads) never interleave inside a line. A crash can leave at most a torn last line;
the reader skips lines that are not valid JSON (a strict prefix of a JSON object never
is) and counts them, and the next writer first ends such a fragment with a newline so
later records stay readable.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from preheat.errors import ConfigError

__all__ = [
    "IMAGE_SOURCES",
    "STAGES",
    "STAGE_BOUNDARIES",
    "WEIGHTS_SOURCES",
    "EventClass",
    "EventLog",
    "JsonlReadResult",
    "SampledLog",
    "StartRecord",
    "read_jsonl",
    "read_start_records",
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
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"StartRecord.{name} = {value!r} is not a finite epoch time in seconds")


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
        for source, n in self.bytes_from.items():
            if source not in WEIGHTS_SOURCES:
                raise ValueError(
                    f"StartRecord.bytes_from has source {source!r}; use cache, peer or origin"
                )
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"StartRecord.bytes_from[{source!r}] = {n!r}; give bytes >= 0")
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


# --- JSONL log ----------------------------------------------------------------------------


class _Jsonable(Protocol):
    def to_json(self) -> str: ...


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class JsonlReadResult(Generic[T]):
    """Records read from a JSONL file, and how many torn (non-JSON) lines were skipped."""

    records: list[T]
    skipped: int


class EventLog:
    """Append-only JSON-lines file: one record per line, one ``write(2)`` per record.

    Safe to share between threads and processes (``O_APPEND``). Call ``close()`` or use it
    as a context manager; a closed log reopens on the next ``append``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        hooks: Iterable[Callable[[Any], object]] = (),
    ) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._fd: int | None = None
        #: Called with each record after it is written (exporters: ``observe_start``).
        self.hooks: list[Callable[[Any], object]] = list(hooks)
        #: Hook failures: a broken exporter never fails the start it describes.
        self.hook_errors = 0
        self.last_hook_error: str | None = None

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        # A previous writer may have died mid-line: end its fragment so ours parses.
        size = os.fstat(fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(fd, b"\n")
        self._fd = fd
        return fd

    def append(self, record: _Jsonable) -> None:
        """Write one record as one line (durable on return when ``fsync=True``), then run
        the hooks; a hook that raises is counted in ``hook_errors``, not propagated."""
        self.append_line(record.to_json())
        for hook in self.hooks:
            try:
                hook(record)
            except Exception as exc:
                self.hook_errors += 1
                self.last_hook_error = f"{getattr(hook, '__qualname__', hook)}: {exc!r}"

    def append_line(self, line: str) -> None:
        """Write one already-encoded JSON object (no newline inside) as one line."""
        fd = self._fd if self._fd is not None else self._open()
        os.write(fd, (line + "\n").encode())
        if self._fsync:
            os.fsync(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> list[StartRecord]:
        """The start records in this log (torn lines skipped)."""
        return read_start_records(self.path)


class SampledLog:
    """Writes a deterministic fraction ``rate`` of the records offered to an ``EventLog``.

    For per-request records (routing decisions) where one line per request would cost more
    disk than it is worth. Sampling is by a credit counter, not a random draw: with rate
    0.1 exactly every tenth record is written, so a run's sample size is predictable and
    a skipped record costs one float addition.
    """

    def __init__(self, log: EventLog, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"sample rate {rate} is outside (0, 1]; use 1.0 to keep every record")
        self.log = log
        self.rate = rate
        self._credit = 1.0 - rate  # so the first record offered is written
        self.offered = 0
        self.written = 0

    def offer(self, record: _Jsonable) -> bool:
        """Write ``record`` if it falls in the sample; return whether it was written."""
        self.offered += 1
        self._credit += self.rate
        if self._credit < 1.0:
            return False
        self._credit -= 1.0
        self.log.append(record)
        self.written += 1
        return True


def _iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def read_jsonl(
    path: str | os.PathLike[str], decode: Callable[[dict[str, Any]], T]
) -> JsonlReadResult[T]:
    """Read a JSONL file with ``decode`` per object.

    Lines that are not valid JSON are torn writes from a crash and are skipped (counted in
    ``skipped``). A line that is valid JSON but not a valid record is a real error: it
    raises ``ConfigError`` naming the file, line and problem.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"events file {str(p)!r} does not exist; give a JSONL file path")
    records: list[T] = []
    skipped = 0
    for lineno, line in _iter_lines(p):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if not isinstance(data, dict):
            raise ConfigError(f"{p}:{lineno}: expected a JSON object, got {type(data).__name__}")
        try:
            records.append(decode(data))
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{p}:{lineno}: {exc}") from None
    return JsonlReadResult(records, skipped)


def read_start_records(path: str | os.PathLike[str]) -> list[StartRecord]:
    """All start records in a JSONL file, skipping a torn last line."""
    return read_jsonl(path, StartRecord.from_dict).records
