"""The pieces of a node agent's ``NodeCache`` object, built from plain data: the object it
creates when none exists, the held and pending revisions of its status, the last failure,
and the hysteresis that keeps a moving ``freeBytes`` from causing a write. Pure: the
writer (:mod:`preheat.runtime.kubernetes.agent_status`) reads the store, the clock and the
API and calls these (and :func:`~preheat.runtime.kubernetes.nodecache_status.nodecache_status`)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from preheat.artifacts.refs import redact_url
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_status import HeldRevision, WantedRevision

if TYPE_CHECKING:
    from preheat.runtime.kubernetes.agent_warmups import Warm
    from preheat.store.evict import SnapshotInfo
    from preheat.telemetry.inventory import WarmupFailure

__all__ = [
    "FREE_HYSTERESIS",
    "drop_none",
    "failure_condition",
    "held_revisions",
    "iso",
    "keep_free_bytes",
    "nodecache_object",
    "pending_revisions",
]

#: freeBytes changes smaller than this (or 1 %) are not worth a status write.
FREE_HYSTERESIS = 64 << 20


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: drop_none(v) for k, v in d.items() if v is not None}
    if isinstance(d, list):
        return [drop_none(v) for v in d]
    return d


def nodecache_object(node: str, store_path: str, capacity: int | None) -> dict[str, Any]:
    """The ``NodeCache`` an agent creates for its node when there is none."""
    spec: dict[str, Any] = {"node": node, "storePath": store_path}
    if capacity is not None:
        spec["capacityBytes"] = capacity
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "NodeCache",
        "metadata": {"name": node, "labels": {"app.kubernetes.io/part-of": "preheat"}},
        "spec": spec,
    }


def held_revisions(infos: Iterable[SnapshotInfo]) -> list[HeldRevision]:
    """The status rows of the snapshots the store holds."""
    return [
        HeldRevision(
            manifest_digest=i.digest,
            revision=i.revisions[-1] if i.revisions else f"sha256:{i.digest}",
            source=i.refs[-1] if i.refs else None,
            size_bytes=i.size,
            pinned=i.pinned,
            leases=len(i.leases),
            last_used=iso(i.last_use),
        )
        for i in infos
    ]


def pending_revisions(warms: Iterable[Warm]) -> list[WantedRevision]:
    """The status rows of the warm-ups in flight (sources redacted)."""
    return [
        WantedRevision(w.revision or redact_url(w.source), w.source, w.state, w.done, w.reason)
        for w in warms
    ]


def failure_condition(fail: WarmupFailure | None) -> dict[str, Any] | None:
    """The status's ``lastFailure`` for the agent's last failed warm-up."""
    if fail is None:
        return None
    return {
        "time": iso(fail.at),
        "reason": "WarmupFailed",
        "message": redact_url(f"{fail.revision}: {fail.reason}"),
    }


def keep_free_bytes(status: dict[str, Any], previous: dict[str, Any]) -> None:
    """Keep the stored ``freeBytes`` in ``status`` while the new value is within
    ``FREE_HYSTERESIS`` (or 1 %) of it: the disk's free space moves all the time."""
    old_free = previous.get("freeBytes")
    if isinstance(old_free, int) and abs(status["freeBytes"] - old_free) < max(
        FREE_HYSTERESIS, old_free // 100
    ):
        status["freeBytes"] = old_free
