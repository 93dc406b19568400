"""The image side of the cache status, from plain data (pure: no I/O, no clock).

Three views of one fact (which node holds which image since when):

- the rows of a node agent's ``NodeCache.status.images`` (:func:`image_rows`): one per
  image its store holds (``Ready``, with ``readyAt`` = when the pull finished) and one
  per wanted image not held yet (``Pulling`` with the bytes so far, or ``Failed`` with the
  reason), keyed by the normalised reference (``registry/repository:tag`` or ``@digest``);
- the ``ModelImageCache.status`` the operator aggregates from the target nodes' rows
  (:func:`image_cache_status`: ``nodes``, ``readyNodes``, ``digest``, conditions ``Ready``
  and ``Degraded``);
- whether a pod's node held the pod's image before the pod was created
  (:func:`image_held_before`, for the start records' ``image_source``).

Weights rows get their arrival time too (:func:`add_revision_ready_at`): ``readyAt`` on
each ``Ready`` revision, when its snapshot was published in the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from preheat.artifacts.refs import redact_url
from preheat.errors import ConfigError
from preheat.images.reference import parse_image_ref
from preheat.runtime.kubernetes.podrecords_core import parse_time

__all__ = [
    "HeldImage",
    "PendingImage",
    "add_revision_ready_at",
    "image_cache_status",
    "image_held_before",
    "image_held_by_node",
    "image_key",
    "image_rows",
]


def image_key(ref: str) -> str:
    """The normalised reference rows are matched by (``docker.io/library/x:latest`` for
    ``x``); an unparsable reference is kept as written (redacted)."""
    try:
        r = parse_image_ref(ref)
    except ConfigError:
        return redact_url(ref.strip())
    if r.digest and not r.tag:
        return f"{r.name}@{r.digest}"
    return f"{r.name}:{r.tag or 'latest'}"


@dataclass(frozen=True, slots=True)
class HeldImage:
    """An image the node store holds (from ``ImageCache.images()``)."""

    name: str  # registry/repository
    tag: str | None
    digest: str  # what the tag resolved to (index or manifest digest)
    size_bytes: int
    pulled_at: str | None  # RFC 3339
    references: int


@dataclass(frozen=True, slots=True)
class PendingImage:
    """A wanted image not held yet: ``Pulling`` (``bytes_done``) or ``Failed`` (``reason``)."""

    image: str
    state: str
    bytes_done: int = 0
    reason: str | None = None
    digest: str | None = None


def image_rows(held: Sequence[HeldImage], pending: Sequence[PendingImage]) -> list[dict[str, Any]]:
    """``NodeCache.status.images``: held images first (by key), then the pending ones."""
    rows: dict[str, dict[str, Any]] = {}
    for h in held:
        key = f"{h.name}:{h.tag}" if h.tag else f"{h.name}@{h.digest}"
        row = {"image": key, "digest": h.digest, "bytes": h.size_bytes, "state": "Ready",
               "readyAt": h.pulled_at, "references": h.references}  # fmt: skip
        rows[key] = {k: v for k, v in row.items() if v is not None}
    out = [rows[k] for k in sorted(rows)]
    for p in sorted(pending, key=lambda p: p.image):
        key = image_key(p.image)
        if key in rows:
            continue
        row = {"image": key, "digest": p.digest, "bytes": p.bytes_done, "state": p.state,
               "message": redact_url(p.reason) if p.reason else None}  # fmt: skip
        out.append({k: v for k, v in row.items() if v is not None})
    return out


def _row_for(status: Mapping[str, Any], image: str, digest: str | None) -> Mapping[str, Any]:
    key = image_key(image)
    for row in status.get("images") or ():
        if row.get("image") == key or (digest and row.get("digest") == digest):
            return dict(row)
    return {}


def image_held_before(nodecache: Mapping[str, Any] | None, image: str, t: float | None) -> bool:
    """Whether the node's ``NodeCache`` says it held ``image`` (``Ready``) no later than
    epoch ``t`` (``readyAt`` absent: held since before anything was recorded)."""
    digest = image.partition("@")[2] or None
    row = _row_for((nodecache or {}).get("status") or {}, image, digest)
    if row.get("state") != "Ready":
        return False
    at = parse_time(row.get("readyAt"))
    return at is None or t is None or at <= t


def _condition(
    kind: str, ok: bool, reason: str, message: str, now: str, prev: Mapping[str, Any]
) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = prev.get(kind) or {}
    since = old.get("lastTransitionTime") if old.get("status") == status else None
    out = {"type": kind, "status": status, "reason": reason, "lastTransitionTime": since or now}
    if message:
        out["message"] = redact_url(message)
    return out


def image_cache_status(
    *,
    image: str,
    generation: int,
    target_nodes: Iterable[str],
    nodecaches: Mapping[str, Mapping[str, Any]],
    now: str,
    previous: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``ModelImageCache.status`` for ``image`` over ``target_nodes`` (node -> its
    ``NodeCache``): ``Ready`` once every target node holds it, ``Degraded`` while any
    target node's pull failed. Per-node transition times are kept while a state holds."""
    prev = previous or {}
    prev_nodes = {n.get("name"): n for n in prev.get("nodes") or ()}
    nodes: list[dict[str, Any]] = []
    digests: list[str] = []
    for name in sorted(set(target_nodes)):
        row = _row_for((nodecaches.get(name) or {}).get("status") or {}, image, None)
        state = {"Ready": "Ready", "Pulling": "Pulling", "Failed": "Failed"}.get(
            str(row.get("state")), "Pending"
        )
        old = prev_nodes.get(name) or {}
        entry: dict[str, Any] = {"name": name, "state": state, "bytes": int(row.get("bytes") or 0)}
        if row.get("message"):
            entry["message"] = redact_url(str(row["message"]))
        same = old.get("state") == state and old.get("lastTransitionTime")
        entry["lastTransitionTime"] = old["lastTransitionTime"] if same else now
        if state == "Ready" and row.get("digest"):
            digests.append(str(row["digest"]))
        nodes.append(entry)
    ready = [n["name"] for n in nodes if n["state"] == "Ready"]
    failed = [n for n in nodes if n["state"] == "Failed"]
    waiting = [n["name"] for n in nodes if n["state"] != "Ready"]
    prev_conds = {c.get("type"): c for c in prev.get("conditions") or ()}
    if not nodes:
        ready_c = _condition("Ready", False, "NoTargetNodes", "no node matches spec.nodes", now,
                             prev_conds)  # fmt: skip
    elif waiting:
        reason = "PullFailed" if failed and len(failed) == len(waiting) else "Pulling"
        ready_c = _condition("Ready", False, reason, f"not yet on: {', '.join(waiting)}", now,
                             prev_conds)  # fmt: skip
    else:
        ready_c = _condition("Ready", True, "AllNodesReady", "", now, prev_conds)
    msg = "; ".join(f"{n['name']}: {n.get('message', 'failed')}" for n in failed)
    degraded = _condition("Degraded", bool(failed), "PullFailed" if failed else "AsExpected",
                          msg, now, prev_conds)  # fmt: skip
    out: dict[str, Any] = {
        "observedGeneration": generation,
        "targetNodes": [n["name"] for n in nodes],
        "readyNodes": len(ready),
        "nodes": nodes,
        "conditions": [ready_c, degraded],
    }
    if digests:
        out["digest"] = sorted(set(digests))[0]
    return out


def add_revision_ready_at(status: dict[str, Any], ready_at: Mapping[str, str | None]) -> None:
    """Add ``readyAt`` (revision -> RFC 3339) to the ``Ready`` rows of a NodeCache status."""
    for row in status.get("revisions") or ():
        at = ready_at.get(str(row.get("revision")))
        if row.get("state") == "Ready" and at:
            row["readyAt"] = at


def image_held_by_node(
    pod: Mapping[str, Any], nodecaches: Mapping[str, Mapping[str, Any]]
) -> bool | None:
    """Whether the pod's node held its engine image (container ``engine``, else the first)
    before the pod was created; ``None`` when the node has no NodeCache (no agent)."""
    spec = pod.get("spec") or {}
    nodecache = nodecaches.get(str(spec.get("nodeName") or ""))
    containers = list(spec.get("containers") or ())
    engine = next((c for c in containers if c.get("name") == "engine"), None)
    image = (engine or (containers[0] if containers else {})).get("image")
    if nodecache is None or not image:
        return None
    created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    return image_held_before(nodecache, str(image), created)
