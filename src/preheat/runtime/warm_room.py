"""Room for a warm-up: evict by plan, sparing other warm-ups' copies no replica has used.

Warm-all on a node smaller than the catalog used to cycle: each warm-up's fill evicted
the copy an earlier warm-up had just made (least recently used first), which the next
warm-up then fetched again, and no replica ever found a warm copy (the simulator showed
1,020 warm-ups and 1,012 evictions where 38 and 12 do, ``preheat sim coldstart``).

``WarmCopies`` remembers, per node, the snapshots this fleet's warm-ups published and
their ``last_use`` then. A copy is *unused* while no replica holds a lease on it and its
``last_use`` has not moved (a replica's lease or pull of it moves it). Before a warm-up
fills, ``make_room`` looks at the eviction the store would do for it
(``NodeStore.plan_eviction``, priority then least recent use); when that would take an
unused warmed copy, it plans again with those copies spared
(``store.evict.plan_eviction(spare=...)``) and carries that plan out
(``NodeStore.execute``, which re-checks pins, leases and blobs of fills in flight), so the
store's own reservation finds the room. When only unused warmed copies could make the
room, the warm-up is refused (``WarmupDeferred``) and retried later: it waits for a
replica to use a copy (then that copy may go) or for space.

A replica's own pull never goes through here: starts evict as before.

Not covered: copies warmed before this fleet process started (unknown here, so they are
evicted as any other), and a concurrent fill on the same node that takes the room between
``make_room`` and the store's reservation (the store then evicts by its own order).
"""

from __future__ import annotations

import contextlib

from preheat.config import format_size
from preheat.errors import WarmupDeferred
from preheat.store.evict import SnapshotInfo, plan_eviction
from preheat.store.store import NodeStore

__all__ = ["WarmCopies"]


class WarmCopies:
    """Warm-ups' copies per node and whether a replica has used them (module docstring)."""

    def __init__(self) -> None:
        #: node -> snapshot digest -> its ``last_use`` when the warm-up published it.
        self._copies: dict[str, dict[str, float]] = {}

    def record(self, node: str, store: NodeStore, digest: str) -> None:
        """A warm-up on ``node`` published ``digest`` (call after pinning it)."""
        for s in store.snapshots():
            if s.digest == digest:
                self._copies.setdefault(node, {})[digest] = s.last_use

    def unused(self, node: str, snapshots: list[SnapshotInfo]) -> frozenset[str]:
        """Digests of ``node``'s warmed copies that no replica has used yet (still there)."""
        copies = self._copies.get(node, {})
        present = {s.digest for s in snapshots}
        for gone in [d for d in copies if d not in present]:
            del copies[gone]
        return frozenset(
            s.digest
            for s in snapshots
            if s.digest in copies and not s.leases and s.last_use <= copies[s.digest]
        )

    def make_room(self, node: str, store: NodeStore, size: int, what: str) -> int:
        """Free room for a warm-up fill of ``size`` bytes without evicting an unused warmed
        copy (module docstring); returns how many such copies were spared. Raises
        ``WarmupDeferred`` when only those copies could make the room."""
        need = size - store.free_bytes()
        if need <= 0:
            return 0
        snaps = store.snapshots()
        spare = self.unused(node, snaps)
        if not spare or not spare & set(store.plan_eviction(need).snapshots):
            return 0  # the store's own eviction takes none of them
        sizes: dict[str, int] = {}
        for s in snaps:
            for b in s.blobs:
                with contextlib.suppress(OSError):
                    sizes[b] = store.layout.blob(b).stat().st_size
        plan = plan_eviction(snaps, sizes, need, spare=spare)
        if not plan.enough:
            kept = sum(s.size for s in snaps if s.digest in spare)
            err = WarmupDeferred(
                f"warming {what} on {node} needs {format_size(need)} more room and only "
                f"{format_size(plan.frees)} is evictable without {len(spare)} warmed "
                f"cop{'y' if len(spare) == 1 else 'ies'} no replica has used yet "
                f"({format_size(kept)}); a warm-up never evicts those; retried later (a "
                "replica's use frees them for eviction), or raise the node's capacity"
            )
            err.need, err.free, err.evictable = need, store.free_bytes(), plan.frees
            raise err
        store.execute(plan)
        return len(spare)
