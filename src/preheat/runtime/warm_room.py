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

Both the local fleet (``runtime.warmup``, through ``NodeCache.pull``) and the node agent
(``agent_warmups``) pass it.

A replica's own pull spares nothing: starts evict as before.
"""

from __future__ import annotations

from preheat.store.store import NodeStore
from preheat.store.warm_record import WarmRecord

__all__ = ["WarmCopies"]


class WarmCopies:
    """Warm-ups' copies per node store and whether a replica has used them (module
    docstring); the record lives in each store, so this object holds no state."""

    def record(self, node: str, store: NodeStore, digest: str) -> None:
        """A warm-up on ``node`` published ``digest`` (call before its origin slot frees)."""
        for s in store.snapshots():
            if s.digest == digest:
                WarmRecord(store.root).mark(s)

    def unused(self, store: NodeStore) -> frozenset[str]:
        """Digests of the store's warmed copies that no replica has used yet: the
        ``spare`` of a warm-up's fill."""
        return WarmRecord(store.root).unused(store.snapshots())
