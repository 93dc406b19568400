"""A replica start attempt as a ``StartRecord``: the supervisor's stage stamps
(``runtime.replicas``), made monotonic, with the start's class, sources and bytes.

An engine-reported stage time may predate the supervisor's own stamp of the stage
before it by clock granularity: each stamp is clamped between its neighbours, and
``weights_loaded`` never comes after ``healthy``. A failure reason is redacted
(``redact_url``) before it is written.
"""

from __future__ import annotations

from typing import Any

from preheat.artifacts.refs import redact_url
from preheat.runtime.model import Replica
from preheat.telemetry.events import StartRecord
from preheat.telemetry.records import STAGES

__all__ = ["start_record"]


def start_record(
    endpoint: str,
    r: Replica,
    scheduled: float,
    stamps: dict[str, float | None],
    event_class: Any,
    sources: tuple[str | None, str],
    bytes_from: dict[str, int],
    failure: str | None,
) -> StartRecord:
    """The record of one start of ``r`` (``sources``: image, weights); ValueError when
    the record cannot be made (``StartRecord``'s own checks)."""
    prev = scheduled
    clean: dict[str, float | None] = {}
    for name in STAGES:
        v = stamps.get(name)
        if v is None:
            clean[name] = None
            continue
        v = max(v, prev)
        clean[name] = v
        prev = v
    loaded, healthy = clean.get("weights_loaded"), clean.get("healthy")
    if loaded is not None and healthy is not None:
        clean["weights_loaded"] = min(loaded, healthy)
    return StartRecord(
        endpoint=endpoint,
        variant=r.variant,
        replica=r.id,
        node=r.node,
        revision=r.revision,
        event_class=event_class,
        scheduled=scheduled,
        image_ready=clean["image_ready"],
        weights_ready=clean["weights_ready"],
        runtime_started=clean["runtime_started"],
        weights_loaded=clean["weights_loaded"],
        healthy=clean["healthy"],
        first_response=clean["first_response"],
        image_source=sources[0],
        weights_source=sources[1],
        bytes_from={k: v for k, v in bytes_from.items() if v},
        restart_count=r.restarts,
        failure=None if failure is None else redact_url(failure),
    )
