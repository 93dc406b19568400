"""A crash-safe JSONL log for start records (and any other record with ``to_json``).

``EventLog`` appends records as JSON lines. Each record is one ``write(2)`` on a file
opened with ``O_APPEND``: no userspace buffer to lose, and concurrent writers (processes
or threads) never interleave inside a line. A crash can leave at most a torn last line;
the reader skips lines that are not valid JSON (a strict prefix of a JSON object never
is) and counts them, and the next writer first ends such a fragment with a newline so
later records stay readable.

The records themselves (``StartRecord``, ``EventClass``, the stage names) are pure values
in ``preheat.telemetry.records``; they are re-exported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from preheat.errors import ConfigError
from preheat.telemetry.records import (
    IMAGE_SOURCES,
    SCHEMA_VERSION,
    STAGE_BOUNDARIES,
    STAGES,
    WEIGHTS_SOURCES,
    EventClass,
    StartRecord,
    WarmupRecord,
)

__all__ = [
    "IMAGE_SOURCES",
    "SCHEMA_VERSION",
    "STAGES",
    "STAGE_BOUNDARIES",
    "WEIGHTS_SOURCES",
    "EventClass",
    "EventLog",
    "JsonlReadResult",
    "SampledLog",
    "StartRecord",
    "WarmupRecord",
    "read_jsonl",
    "read_start_records",
]


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
