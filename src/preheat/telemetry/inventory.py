"""Per-node cache inventory: what each node's store holds and what the controller thinks of it.

A ``NodeInventory`` joins two views of one node:

- the store's (``NodeStore.snapshots()``, ``free_bytes()``, ``plan_eviction()``): revisions
  present, bytes, last use, leases (who holds it), pinned, priority, free space and the
  snapshots it would evict next;
- the controller's: which revisions it marked ready on the node, and the last warm-up
  failure with its reason (a full disk, an unreachable origin).

It renders as a rich table (``preheat cache ls``-style), as JSON, and as Prometheus
gauges (``TelemetryMetrics.set_inventory``). Building one reads the store; rendering is
pure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.table import Table

from preheat.artifacts.refs import redact_url
from preheat.config import format_size

__all__ = [
    "NodeInventory",
    "SnapshotEntry",
    "StoreView",
    "WarmupFailure",
    "inventory_from_json",
    "inventory_from_store",
    "inventory_table",
    "inventory_to_json",
]


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    """One snapshot in a node store."""

    revision: str
    size_bytes: int
    last_use: float | None = None
    pinned: bool = False
    priority: int = 0
    leased_by: tuple[str, ...] = ()
    manifest_digest: str | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class WarmupFailure:
    """The last failed warm-up of a node, as the controller saw it. ``reason`` is
    redacted (``redact_url``) when built: it becomes a Prometheus label on the
    token-free ``/metrics`` and a line in status and reports."""

    revision: str
    reason: str
    at: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", redact_url(self.reason))


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """One node's cache: snapshots, free space, eviction order, readiness, last failure."""

    node: str
    free_bytes: int
    snapshots: tuple[SnapshotEntry, ...] = ()
    capacity_bytes: int | None = None
    #: Revisions the store would evict first (leased and pinned ones never appear).
    eviction_candidates: tuple[str, ...] = ()
    #: Revision -> whether the controller marked it ready on this node.
    ready: Mapping[str, bool] = field(default_factory=dict)
    last_warmup_failure: WarmupFailure | None = None

    @property
    def used_bytes(self) -> int:
        return sum(s.size_bytes for s in self.snapshots)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "capacity_bytes": self.capacity_bytes,
            "free_bytes": self.free_bytes,
            "used_bytes": self.used_bytes,
            "snapshots": [
                {
                    "revision": s.revision,
                    "manifest_digest": s.manifest_digest,
                    "source": s.source,
                    "size_bytes": s.size_bytes,
                    "last_use": s.last_use,
                    "pinned": s.pinned,
                    "priority": s.priority,
                    "leased_by": list(s.leased_by),
                    "ready": self.ready.get(s.revision),
                }
                for s in self.snapshots
            ],
            "eviction_candidates": list(self.eviction_candidates),
            "ready": dict(self.ready),
            "last_warmup_failure": None
            if self.last_warmup_failure is None
            else {
                "revision": self.last_warmup_failure.revision,
                "reason": self.last_warmup_failure.reason,
                "at": self.last_warmup_failure.at,
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeInventory:
        fail = d.get("last_warmup_failure")
        return cls(
            node=d["node"],
            free_bytes=int(d["free_bytes"]),
            capacity_bytes=d.get("capacity_bytes"),
            snapshots=tuple(
                SnapshotEntry(
                    revision=s["revision"],
                    size_bytes=int(s["size_bytes"]),
                    last_use=s.get("last_use"),
                    pinned=bool(s.get("pinned", False)),
                    priority=int(s.get("priority", 0)),
                    leased_by=tuple(s.get("leased_by", ())),
                    manifest_digest=s.get("manifest_digest"),
                    source=s.get("source"),
                )
                for s in d.get("snapshots", ())
            ),
            eviction_candidates=tuple(d.get("eviction_candidates", ())),
            ready={str(k): bool(v) for k, v in d.get("ready", {}).items()},
            last_warmup_failure=None
            if not fail
            else WarmupFailure(fail["revision"], fail["reason"], float(fail["at"])),
        )


class StoreView(Protocol):
    """What inventory needs from a ``NodeStore``."""

    def snapshots(self) -> Sequence[Any]: ...

    def free_bytes(self) -> int: ...


def _attr(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if isinstance(obj, Mapping) and name in obj:
            return obj[name]
        if hasattr(obj, name):
            return getattr(obj, name)
    return default


def _entry(info: Any) -> SnapshotEntry:
    leases = _attr(info, "leases", "leased_by", default=()) or ()
    if isinstance(leases, int):
        leased_by: tuple[str, ...] = tuple(f"lease-{i}" for i in range(leases))
    else:
        leased_by = tuple(str(_attr(x, "holder", "owner", "name", default=x)) for x in leases)
    revisions = _attr(info, "revisions", default=()) or ()
    digest = _attr(info, "manifest_digest", "digest")
    revision = revisions[0] if revisions else _attr(info, "revision", default=digest)
    return SnapshotEntry(
        revision=str(revision),
        size_bytes=int(_attr(info, "size", "size_bytes", "bytes", default=0)),
        last_use=_attr(info, "last_use", "last_used"),
        pinned=bool(_attr(info, "pinned", default=False)),
        priority=int(_attr(info, "priority", default=0)),
        leased_by=leased_by,
        manifest_digest=digest,
        source=_first(_attr(info, "refs", "source", "ref")),
    )


def _first(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    items = list(value)
    return str(items[0]) if items else None


def _eviction_order(store: Any, snapshots: Sequence[SnapshotEntry], limit: int) -> tuple[str, ...]:
    """The snapshots the store would evict first (``eviction_candidates()``, or the order
    of a plan that frees everything it may)."""
    if not snapshots:
        return ()
    order_fn = getattr(store, "eviction_candidates", None)
    if order_fn is not None:
        victims = order_fn()
    else:
        plan_fn = getattr(store, "plan_eviction", None)
        if plan_fn is None:
            return ()
        plan = plan_fn(sum(s.size_bytes for s in snapshots) + 1)
        victims = _attr(plan, "snapshots", "victims", default=plan) or ()
    by_digest = {s.manifest_digest: s.revision for s in snapshots if s.manifest_digest}
    out: list[str] = []
    for v in victims:
        key = str(_attr(v, "digest", "manifest_digest", "revision", default=v))
        out.append(by_digest.get(key, key))
        if len(out) >= limit:
            break
    return tuple(out)


def inventory_from_store(
    node: str,
    store: StoreView,
    *,
    capacity_bytes: int | None = None,
    ready: Mapping[str, bool] | None = None,
    last_warmup_failure: WarmupFailure | None = None,
    eviction_preview: int = 3,
) -> NodeInventory:
    """Read one node's store, joined with the controller's readiness and last failure."""
    snaps = tuple(_entry(s) for s in store.snapshots())
    return NodeInventory(
        node=node,
        free_bytes=int(store.free_bytes()),
        snapshots=snaps,
        capacity_bytes=capacity_bytes,
        eviction_candidates=_eviction_order(store, snaps, eviction_preview),
        ready=dict(ready or {}),
        last_warmup_failure=last_warmup_failure,
    )


def inventory_to_json(nodes: Iterable[NodeInventory]) -> str:
    return json.dumps({"nodes": [n.to_dict() for n in nodes]}, indent=2)


def inventory_from_json(text: str) -> list[NodeInventory]:
    data = json.loads(text)
    return [NodeInventory.from_dict(n) for n in data["nodes"]]


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "never"
    s = max(0.0, now - ts)
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


def inventory_table(nodes: Iterable[NodeInventory], *, now: float | None = None) -> Table:
    """A rich table: one row per (node, snapshot), node free space and last failure."""
    now = time.time() if now is None else now
    t = Table(title="Cache inventory", show_lines=False)
    for col, kw in (
        ("node", {}),
        ("revision", {}),
        ("size", {"justify": "right"}),
        ("last use", {"justify": "right"}),
        ("leased by", {}),
        ("pinned", {}),
        ("prio", {"justify": "right"}),
        ("ready", {}),
        ("evict #", {"justify": "right"}),
    ):
        t.add_column(col, **kw)  # type: ignore[arg-type]
    for n in nodes:
        cap = "" if n.capacity_bytes is None else f" of {format_size(n.capacity_bytes)}"
        header = f"[bold]{n.node}[/bold] free {format_size(n.free_bytes)}{cap}"
        if n.last_warmup_failure is not None:
            f = n.last_warmup_failure
            header += f"  [red]warm-up of {f.revision} failed: {f.reason}[/red]"
        t.add_row(header, *[""] * 8)
        if not n.snapshots:
            t.add_row("", "[dim](empty)[/dim]", *[""] * 7)
        for s in n.snapshots:
            order = (
                str(n.eviction_candidates.index(s.revision) + 1)
                if s.revision in n.eviction_candidates
                else ""
            )
            rdy = n.ready.get(s.revision)
            t.add_row(
                "",
                s.revision,
                format_size(s.size_bytes),
                _ago(s.last_use, now),
                ", ".join(s.leased_by) or "-",
                "yes" if s.pinned else "no",
                str(s.priority),
                "-" if rdy is None else ("yes" if rdy else "no"),
                order,
            )
    return t
