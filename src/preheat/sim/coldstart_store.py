"""One simulated node and its NVMe store: snapshots, leases, pins, reservations, eviction.

Pure. It keeps the metadata a real ``NodeStore`` keeps and no bytes. Making room for a
fill is the live decision: ``store.evict.plan_eviction`` over ``SnapshotInfo`` values
built from this metadata (one blob per revision), so leased and pinned snapshots are
never evicted and priority, then least recent use, decides the rest. Capacity is the
NVMe size times the high watermark, as ``NodeStore`` counts it; fills in flight hold a
reservation and their revision is protected from other fills' evictions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from preheat.store.evict import SnapshotInfo, plan_eviction

__all__ = ["Eviction", "NodeDisk", "Refusal", "Snap"]


def _gb(n: float) -> str:
    return f"{n / 1e9:.0f} GB"


@dataclass
class Snap:
    size: int
    created: float
    last_use: float
    priority: int = 0
    pinned: bool = False
    leases: set[str] = field(default_factory=set)
    #: A replica has read it since it was published (a warm-up's copy starts unused).
    used: bool = False


@dataclass(frozen=True)
class Eviction:
    time: float
    node: str
    revision: str
    priority: int
    last_use: float
    #: The fill that needed the room.
    for_revision: str


@dataclass(frozen=True)
class Refusal:
    """A fill could not get room. ``permanent``: even an empty disk (pins aside) is too
    small, so the revision is ``unfit`` here while the pins stay (``for_good``: the disk
    itself is too small); otherwise leases hold the space for now."""

    reason: str
    permanent: bool
    for_good: bool = False


@dataclass
class NodeDisk:
    name: str
    capacity: int
    slots: int
    #: Joined while the simulation ran (a spot replacement): its first start is new_node.
    added: bool = False
    up: bool = True
    hosted_any: bool = False
    snaps: dict[str, Snap] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return sum(s.size for s in self.snaps.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used - sum(self.reserved.values())

    def holds(self, revision: str) -> bool:
        return revision in self.snaps

    def infos(self) -> list[SnapshotInfo]:
        return [
            SnapshotInfo(
                digest=rev,
                size=s.size,
                files=1,
                created=s.created,
                last_use=s.last_use,
                pinned=s.pinned,
                leases=tuple(sorted(s.leases)),
                priority=s.priority,
                blobs=frozenset({rev}),
            )
            for rev, s in self.snaps.items()
        ]

    def reserve(
        self, revision: str, size: int, now: float, *, warm_up: bool = False
    ) -> list[Eviction] | Refusal:
        """Hold ``size`` bytes for a fill of ``revision``, evicting by plan if needed. A
        ``warm_up`` never evicts a copy no replica has used yet (another warm-up's), so
        warm-ups below the catalog size do not evict and re-warm each other."""
        pinned = sum(s.size for s in self.snaps.values() if s.pinned)
        if size > self.capacity - pinned:
            return Refusal(
                f"{self.name} cannot hold {_gb(size)}: capacity "
                f"{_gb(self.capacity)} with {_gb(pinned)} pinned",
                permanent=True,
                for_good=size > self.capacity,
            )
        need = size - self.free
        evicted: list[Eviction] = []
        if need > 0:
            # the live warm-up's rule too (``runtime.warm_room``): ``spare`` unused copies
            spare = [r for r, s in self.snaps.items() if warm_up and not s.used]
            blob_sizes = {rev: s.size for rev, s in self.snaps.items()}
            plan = plan_eviction(
                self.infos(), blob_sizes, need, protected=self.reserved, spare=spare
            )
            if not plan.enough:
                return Refusal(
                    f"{self.name} has {_gb(self.free)} free and only "
                    f"{_gb(plan.frees)} evictable (the rest is leased, pinned, reserved or "
                    f"a warm-up's copy not used yet); {_gb(size)} needed",
                    permanent=False,
                )
            for rev in plan.snapshots:
                s = self.snaps.pop(rev)
                evicted.append(Eviction(now, self.name, rev, s.priority, s.last_use, revision))
        self.reserved[revision] = size
        return evicted

    def release(self, revision: str) -> None:
        self.reserved.pop(revision, None)

    def publish(self, revision: str, size: int, now: float, *, priority: int, pinned: bool) -> None:
        self.reserved.pop(revision, None)
        self.snaps[revision] = Snap(size, now, now, priority, pinned)

    def lease(self, revision: str, replica: str, now: float) -> None:
        s = self.snaps[revision]
        s.leases.add(replica)
        s.last_use = now
        s.used = True

    def unlease(self, revision: str, replica: str, now: float) -> None:
        s = self.snaps.get(revision)
        if s is not None and replica in s.leases:
            s.leases.discard(replica)
            s.last_use = now
