"""What a node agent writes: its ``NodeCache`` status, its Node's revision labels, and which
``ModelDataCache`` objects target its node. Pure functions over plain data; the agent
(:mod:`preheat.runtime.kubernetes.agent`) reads the store and the API and calls these.

Contracts (docs/kubernetes.md, "The node agent"):

- a ``ModelDataCache`` targets a node when ``spec.nodes.names`` lists it, or when every
  label of ``spec.nodes.selector`` matches the node's labels; with neither, every node;
- a Node holding a snapshot carries ``preheat.dev/rev-<first 12 hex of the manifest
  digest>: "true"`` (27 characters of key name, under the 63-character limit);
- a pod uses a snapshot when it has the annotation ``preheat.dev/snapshot: <manifest
  digest or revision>``; its node's agent leases that snapshot for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from preheat.artifacts.refs import redact_url

__all__ = [
    "LABEL_PREFIX",
    "SNAPSHOT_ANNOTATION",
    "HeldRevision",
    "WantedRevision",
    "nodecache_status",
    "revision_label",
    "revision_labels_patch",
    "targets_node",
]

#: Node label prefix, one label per snapshot the node's store holds.
LABEL_PREFIX = "preheat.dev/rev-"
#: Pod annotation naming the snapshot (manifest digest or revision) the pod runs from.
SNAPSHOT_ANNOTATION = "preheat.dev/snapshot"
_HEX = frozenset("0123456789abcdef")


def revision_label(manifest_digest: str) -> str:
    """The Node label key for a snapshot: ``preheat.dev/rev-`` + 12 hex of its digest."""
    hexpart = manifest_digest.removeprefix("sha256:").lower()
    if len(hexpart) < 12 or not set(hexpart[:12]) <= _HEX:
        raise ValueError(
            f"manifest digest {manifest_digest!r} is not a sha256 hex digest; "
            "pass the snapshot's manifest digest (64 hex characters)"
        )
    return LABEL_PREFIX + hexpart[:12]


def revision_labels_patch(current: Mapping[str, str], held: Iterable[str]) -> dict[str, str | None]:
    """A merge patch for the Node's labels: add a label per held digest, drop (``None``)
    the preheat revision labels of snapshots no longer held; empty when nothing changes."""
    want = {revision_label(d) for d in held}
    patch: dict[str, str | None] = {k: "true" for k in sorted(want) if current.get(k) != "true"}
    for key in sorted(current):
        if key.startswith(LABEL_PREFIX) and key not in want:
            patch[key] = None
    return patch


def targets_node(spec: Mapping[str, Any], node: str, labels: Mapping[str, str]) -> bool:
    """Whether a ``ModelDataCache`` spec targets ``node`` (names, else selector, else all;
    never a node in ``exclude``)."""
    nodes = spec.get("nodes") or {}
    if node in (nodes.get("exclude") or ()):
        return False
    names = nodes.get("names") or []
    selector = nodes.get("selector") or {}
    if names and node in names:
        return True
    if selector:
        return all(labels.get(k) == v for k, v in selector.items())
    return not names


@dataclass(frozen=True, slots=True)
class HeldRevision:
    """A snapshot in the store."""

    manifest_digest: str
    revision: str
    source: str | None
    size_bytes: int
    pinned: bool
    leases: int
    last_used: str | None


@dataclass(frozen=True, slots=True)
class WantedRevision:
    """A revision some ``ModelDataCache`` wants here that the store does not hold yet."""

    revision: str
    source: str
    state: str  # Filling | Failed
    bytes_done: int = 0
    #: Why a ``Failed`` fill failed: ``NoRoom`` (the store cannot make room now), or "".
    reason: str = ""


def _condition(
    kind: str, ok: bool, reason: str, message: str, generation: int, previous: Mapping[str, Any]
) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(kind) or {}
    same = old.get("status") == status
    out: dict[str, Any] = {
        "type": kind,
        "status": status,
        "reason": reason,
        "observedGeneration": generation,
    }
    if message:  # an empty string is omitted, as the API server would round-trip it
        out["message"] = redact_url(message)
    if same and old.get("lastTransitionTime"):
        out["lastTransitionTime"] = old["lastTransitionTime"]
    return out


def _degraded(
    failed: Sequence[WantedRevision],
    last_failure: Mapping[str, Any] | None,
    other: tuple[str, str] | None,
) -> tuple[str, str]:
    """The Degraded condition's (reason, message)."""
    failure = (last_failure or {}).get("message", "") if failed else ""
    if other is not None:
        reason, message = other
        return reason, f"{message}; warm-up failed: {failure}" if failure else message
    return ("WarmupFailed", failure) if failed else ("AsExpected", "")


def nodecache_status(
    *,
    generation: int,
    now: str,
    capacity_bytes: int | None,
    free_bytes: int,
    held: Sequence[HeldRevision],
    pending: Sequence[WantedRevision],
    wanted: Iterable[str],
    eviction_order: Sequence[str],
    last_failure: Mapping[str, Any] | None,
    previous: Mapping[str, Any] | None = None,
    degraded: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The full ``NodeCache.status`` (``None`` values clear a field in a merge patch).

    ``wanted`` are the revisions this node's ModelDataCaches ask for; ``previous`` is the
    status now stored, whose condition transition times are kept while a status holds;
    ``degraded`` is another (reason, message) the node is Degraded for (invalid peer
    settings), which the condition names before a failed warm-up."""
    prev_conds = {c.get("type"): c for c in (previous or {}).get("conditions") or ()}
    held_revs = {h.revision for h in held} | {h.manifest_digest for h in held}
    missing = sorted(set(wanted) - held_revs)
    failed = [p for p in pending if p.state == "Failed"]
    filling = [p for p in pending if p.state == "Filling"]
    revisions: list[dict[str, Any]] = [
        {
            "revision": h.revision,
            "source": redact_url(h.source) if h.source else None,
            "bytes": h.size_bytes,
            "state": "Ready",
            "pinned": h.pinned,
            "leases": h.leases,
            "lastUsed": h.last_used,
        }
        for h in held
    ]
    revisions += [
        {
            "revision": redact_url(p.revision),
            "source": redact_url(p.source),
            "bytes": p.bytes_done,
            "state": p.state,
            "pinned": False,
            "leases": 0,
            "reason": p.reason or None,
        }
        for p in pending
    ]
    for r in revisions:
        for key in [k for k, v in r.items() if v is None]:
            del r[key]
    if missing:
        ready_msg = f"not yet held: {', '.join(missing)}"
        ready_reason = "WarmupFailed" if failed and not filling else "Warming"
    else:
        ready_msg, ready_reason = "every wanted revision is held", "AllRevisionsReady"
    now_or = {"lastTransitionTime": now}
    conditions = [
        {
            **now_or,
            **_condition("Ready", not missing, ready_reason, ready_msg, generation, prev_conds),
        },
        {
            **now_or,
            **_condition(
                "Progressing",
                bool(filling),
                "Filling" if filling else "Idle",
                ", ".join(p.revision for p in filling),
                generation,
                prev_conds,
            ),
        },
        {
            **now_or,
            **_condition(
                "Degraded",
                bool(failed) or degraded is not None,
                *_degraded(failed, last_failure, degraded),
                generation,
                prev_conds,
            ),
        },
    ]
    used = sum(h.size_bytes for h in held)
    return {
        "observedGeneration": generation,
        "capacityBytes": capacity_bytes,
        "usedBytes": used,
        "freeBytes": max(0, free_bytes),
        "revisionCount": len(held),
        "revisions": revisions,
        "evictionOrder": list(eviction_order),
        "lastFailure": None
        if last_failure is None
        else {k: redact_url(v) if isinstance(v, str) else v for k, v in last_failure.items()},
        "conditions": conditions,
    }
