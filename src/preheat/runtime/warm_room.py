"""Room for a warm-up: evict by plan, sparing other warm-ups' copies no replica has used.

Warm-all on a node smaller than the catalog used to cycle: each warm-up's fill evicted
the copy an earlier warm-up had just made (least recently used first), which the next
warm-up then fetched again, and no replica ever found a warm copy (the simulator showed
1,020 warm-ups and 1,012 evictions where 38 and 12 do, ``preheat sim coldstart``).

``WarmCopies`` marks the snapshots this fleet's (or agent's) warm-ups published, with their
``last_use`` then, in the node store itself (``store.warm_record``: a restart of
``preheat up`` or of the agent still knows them). A copy is *unused* while no replica
holds a lease on it and its ``last_use`` has not moved (a replica's lease or pull of it
moves it). A warm-up's fill passes those copies as ``spare`` to the store
(``NodeStore.apull(spare=...)``): the reservation's own eviction plan (priority then least
recent use, ``store.evict.plan_eviction(spare=...)``), made under the store's write lock,
never takes them, so no concurrent fill on the node can take the room between the
warm-up's eviction and its reservation. When only unused warmed copies could make the
room, the store refuses the warm-up with ``WarmupDeferred`` and it is retried later: it
waits for a replica to use a copy (then that copy may go) or for space.

``make_room`` is the older form for a caller that does not pass ``spare`` to its pull
(the local fleet's ``runtime.warmup``): it evicts by the same plan before the fill, and a
concurrent fill may still take that room before the fill's reservation.

A replica's own pull spares nothing: starts evict as before.
"""

from __future__ import annotations

import contextlib

from preheat.config import format_size
from preheat.errors import WarmupDeferred
from preheat.store.evict import plan_eviction
from preheat.store.store import NodeStore
from preheat.store.warm_record import WarmRecord

__all__ = ["WarmCopies"]


class WarmCopies:
    """Warm-ups' copies per node store and whether a replica has used them (module
    docstring); the record lives in each store, so this object holds no state."""

    def record(self, node: str, store: NodeStore, digest: str) -> None:
        """A warm-up on ``node`` published ``digest`` (call after pinning it)."""
        for s in store.snapshots():
            if s.digest == digest:
                WarmRecord(store.root).mark(s)

    def unused(self, store: NodeStore) -> frozenset[str]:
        """Digests of the store's warmed copies that no replica has used yet: the
        ``spare`` of a warm-up's fill."""
        return WarmRecord(store.root).unused(store.snapshots())

    def make_room(self, node: str, store: NodeStore, size: int, what: str) -> int:
        """Free room for a warm-up fill of ``size`` bytes without evicting an unused warmed
        copy, for a caller whose pull passes no ``spare`` (module docstring); returns how
        many such copies were spared. Raises ``WarmupDeferred`` when only those copies
        could make the room."""
        need = size - store.free_bytes()
        if need <= 0:
            return 0
        snaps = store.snapshots()
        spare = WarmRecord(store.root).unused(snaps)
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
