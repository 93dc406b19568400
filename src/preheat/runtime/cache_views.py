"""The local fleet's node cache views follow the node stores.

A node's ``CacheView`` of a revision (``model.WarmState``) is what the planner counts:
the cache gate's ready nodes, placement's warm nodes, the fan-out's complete holders.
Warm-ups set it (``runtime.warmup``); this module keeps it true to the store on every
tick of ``observe`` (``runtime.local_executor``):

- ``adopt_existing``: once the sources are resolved, a node whose store already holds a
  wanted revision (a restart of ``preheat up``) is ``ready`` for it without a warm-up;
- ``forget_evicted``: a ``ready`` view whose copy the store no longer holds is dropped
  at the tick that sees it, so the planner warms it again. A copy leaves a store behind
  its warm-up's back when another fill's reservation evicts it (a replica's own pull of
  another model, or a second process pulling into the same store), by ``preheat cache
  evict``, or by a ``verify`` that removed it. Before this, the view said ``ready`` for
  as long as the fleet ran: the gate counted the node, placement sent replicas there as
  to a warm node (their start then fetched the weights and was labelled as a warm node's
  start) and the node was never warmed again.

Both read the stores in one worker thread per tick (one small sqlite read per ready
view, about 0.3 ms each).
"""

from __future__ import annotations

import asyncio
import contextlib

from preheat.control.state import CacheView
from preheat.errors import PreheatError
from preheat.runtime.model import FleetState, Node, WarmState, cache_view

__all__ = ["adopt_existing", "forget_evicted"]


async def adopt_existing(st: FleetState) -> None:
    """Nodes whose store already holds a wanted revision are ready for it."""
    for node in st.nodes.values():
        for rv in st.resolved.values():
            if rv.revision in node.views:
                continue
            if await asyncio.to_thread(node.cache.has, rv.revision):
                node.views[rv.revision] = cache_view(WarmState.READY)


async def forget_evicted(st: FleetState) -> None:
    """Drop every ``ready`` view whose copy its store no longer holds (module docstring)."""
    ready = [
        (node, rev, view)
        for node in st.nodes.values()
        if not node.cache.closed
        for rev, view in node.views.items()
        if view.state == WarmState.READY
    ]
    if not ready:
        return

    def gone() -> list[tuple[Node, str, CacheView]]:
        out = []
        for node, rev, view in ready:
            with contextlib.suppress(PreheatError):  # closed meanwhile: the next tick
                if not node.cache.has(rev):
                    out.append((node, rev, view))
        return out

    for node, rev, view in await asyncio.to_thread(gone):
        if node.views.get(rev) is view:  # not set again (re-warmed) meanwhile
            del node.views[rev]
            st.say(f"{rev[:12]} is no longer in its store on {node.name} (evicted): not ready")
