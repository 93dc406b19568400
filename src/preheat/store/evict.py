"""Eviction: a pure plan over the store's metadata, then an execution (in ``NodeStore``).

Algorithm (``plan_eviction``):

1. Blobs that no snapshot references (left by an interrupted fill or a deleted snapshot)
   go first: they cost nothing to lose.
2. Candidates are the snapshots that are neither pinned nor leased (nor in ``spare``: a
   warm-up's fill spares other warm-ups' copies no replica has used yet,
   ``runtime.warm_room``). They are taken in
   order of priority (lowest first), then least recent use (oldest first), then digest
   (a stable tie-break).
3. Removing a snapshot frees the blobs that no *remaining* snapshot shares, except blobs
   a fill in flight is about to link (``protected``).
4. Stop as soon as the freed bytes reach ``need``. ``plan.enough`` says whether they did;
   a plan that is not enough is still returned so callers can report the numbers.

Execution removes pointers first (DB rows, snapshot directories) and blobs last, and
re-checks pins and leases under the store's write lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot as ``NodeStore.snapshots()`` reports it."""

    digest: str
    size: int
    files: int
    created: float
    last_use: float
    pinned: bool
    leases: tuple[str, ...]
    priority: int
    blobs: frozenset[str]
    revisions: tuple[str, ...] = ()
    refs: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()  # names the origin declared ("main"): display only

    @property
    def leased(self) -> bool:
        return bool(self.leases)

    @property
    def evictable(self) -> bool:
        return not self.pinned and not self.leases


@dataclass(frozen=True)
class EvictionPlan:
    """Snapshots then blobs to delete, and how many bytes that frees."""

    need: int
    snapshots: tuple[str, ...]
    blobs: tuple[str, ...]
    frees: int

    @property
    def enough(self) -> bool:
        return self.frees >= self.need

    @property
    def empty(self) -> bool:
        return not self.snapshots and not self.blobs


def eviction_order(snapshots: Iterable[SnapshotInfo]) -> list[SnapshotInfo]:
    """Evictable snapshots in the order they would go."""
    return sorted(
        (s for s in snapshots if s.evictable), key=lambda s: (s.priority, s.last_use, s.digest)
    )


def plan_eviction(
    snapshots: Iterable[SnapshotInfo],
    blob_sizes: Mapping[str, int],
    need: int,
    protected: Iterable[str] = (),
    spare: Iterable[str] = (),
) -> EvictionPlan:
    """The smallest prefix of the eviction order that frees ``need`` bytes (see module doc);
    ``protected``: blobs to keep, ``spare``: snapshot digests that are not candidates."""
    if need <= 0:
        return EvictionPlan(need=need, snapshots=(), blobs=(), frees=0)
    snaps = list(snapshots)
    keep = frozenset(protected)
    spared = frozenset(spare)
    refcount: dict[str, int] = {}
    for s in snaps:
        for b in s.blobs:
            refcount[b] = refcount.get(b, 0) + 1
    frees = 0
    blobs: list[str] = []
    for b in sorted(blob_sizes):
        if frees >= need:
            break
        if refcount.get(b, 0) == 0 and b not in keep:
            blobs.append(b)
            frees += blob_sizes[b]
    chosen: list[str] = []
    for s in eviction_order(snaps):
        if s.digest in spared:
            continue
        if frees >= need:
            break
        chosen.append(s.digest)
        for b in sorted(s.blobs):
            refcount[b] -= 1
            if refcount[b] == 0 and b not in keep and b in blob_sizes:
                blobs.append(b)
                frees += blob_sizes[b]
    return EvictionPlan(need=need, snapshots=tuple(chosen), blobs=tuple(blobs), frees=frees)
