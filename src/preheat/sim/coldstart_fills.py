"""Downloads of weights onto a simulated node: room, source, warm-ups, cancellation.

Pure. A fill reserves room on the node's store (``NodeDisk.reserve``: ``plan_eviction``
decides what goes), then downloads from a peer that holds the revision (``--peers on``,
the one uploading least) or the origin. A planner ``Warm`` is a fill owned by no replica;
a refusal is ``unfit`` when the disk can never hold the model and ``failed`` (retried
when the node's space changes) when leases hold the room. With cache policy ``none``
there is no store: a replica's fill downloads into scratch space that goes with it.
"""

from __future__ import annotations

from preheat.control.fanout import Mode, WarmRequest, plan_fanout
from preheat.control.state import CacheView
from preheat.sim.coldstart_config import model_of
from preheat.sim.coldstart_fleet import FleetState
from preheat.sim.coldstart_flows import ORIGIN
from preheat.sim.coldstart_replicas import Fill
from preheat.sim.coldstart_store import NodeDisk, Refusal

__all__ = ["Fills"]

_NEVER = float("inf")  # retried on an event (space freed, a fill ended), not on a timer


class Fills(FleetState):
    """The fleet's downloads of weights (see the module docstring)."""

    def _source(self, node: str, revision: str) -> str:
        if self.peers:
            holders = [
                n.name for n in self.nodes.values() if n.up and n.name != node and n.holds(revision)
            ]
            if holders:
                return min(holders, key=lambda h: (self.net.uploads(h), h))
        return ORIGIN

    def _fill(self, node: NodeDisk, revision: str, owner: str) -> Fill | Refusal:
        size = self.sizes[revision]
        if self.store:
            got = node.reserve(revision, size, self.agenda.now, warm_up=owner == "warm")
            if isinstance(got, Refusal):
                return got
            self.evictions.extend(got)
            for ev in got:
                self.dirty.add(model_of(ev.revision))
        source = self._source(node.name, revision)
        t = self.net.start(node.name, revision, source, size)
        fill = Fill(node.name, revision, size, t.id, source, owner)
        self.fills[(node.name, revision)] = fill
        self.by_transfer[t.id] = fill
        self.failed_views.pop((node.name, revision), None)
        return fill

    def warm(self, node_name: str, revision: str, model: str) -> None:
        node = self.nodes[node_name]
        if not node.up or node.holds(revision) or (node_name, revision) in self.fills:
            return
        if not self._admitted(node_name, revision):
            self.held.add((node_name, revision))
            self.failed_views[(node_name, revision)] = CacheView(
                "failed", reason="waiting for an origin slot of the warm-up budget", retry_at=_NEVER
            )
            return
        got = self._fill(node, revision, "warm")
        if isinstance(got, Refusal):
            if got.permanent:
                self.failed_views[(node_name, revision)] = unfit_view(got)
            else:
                # Retried when this node's space changes (``space_changed``), not on a timer.
                self.failed_views[(node_name, revision)] = CacheView(
                    "failed", reason=got.reason, retry_at=_NEVER, short_of_room=True
                )
            if not got.for_good and any(
                r != revision and model_of(r) == model for r in node.snaps
            ):  # the planner may give it a superseded copy's room (``control.plan`` step 6)
                self.dirty.add(model)
            return
        self.warmups += 1
        spec = self.models[model].spec
        if spec.image is not None and not self.images.holds(node_name, spec.image):
            self.images.pull(node_name, spec.image, spec.image_size)  # modelCacheConfig.image

    def _admitted(self, node: str, revision: str) -> bool:
        """Whether the budget lets this warm-up start now. With ``--peers on`` and a node
        that holds the revision, it warms from a peer, and only from one that serves
        nobody now (a peer's link is shared with the starts it serves); otherwise it
        needs an origin slot (``control.fanout.plan_fanout``, as the live node agent
        admits one), and every origin fill counts, a replica's own included, so warm-ups
        yield the origin to starts."""
        if self.budget is None:
            return True
        if self.peers:
            holders = [n.name for n in self.nodes.values() if self._holder(n, node, revision)]
            if holders:
                return any(self.net.uploads(h) == 0 for h in holders)
        running = [(f.node, f.revision) for f in self.fills.values() if f.source == ORIGIN]
        req = WarmRequest(node, revision, frozenset({revision}))
        return plan_fanout([req], {}, running, self.budget)[(node, revision)] is not Mode.WAIT

    @staticmethod
    def _holder(n: NodeDisk, node: str, revision: str) -> bool:
        return n.up and n.name != node and n.holds(revision)

    def origin_freed(self) -> None:
        """A fill ended (done or cancelled): let the planner retry the held warm-ups that
        may be admitted now: with ``--peers on`` those of a revision some idle node
        holds, and, in (revision, node) order, as many of the rest as the budget has free
        origin slots. Admission is still ``_admitted``'s; this only chooses whom to wake,
        so that a fill's end does not re-plan every held warm-up of the fleet."""
        if not self.held or self.budget is None:
            return
        origin = [f.revision for f in self.fills.values() if f.source == ORIGIN]
        held = sorted(self.held, key=lambda k: (k[1], k[0]))
        wake = []
        rest = held
        if self.peers:
            held_revs = {k[1] for k in held}
            holders = {
                rev: [n.name for n in self.nodes.values() if n.up and n.holds(rev)]
                for rev in held_revs
            }
            idle = {r for r, hs in holders.items() if any(self.net.uploads(h) == 0 for h in hs)}
            wake = [k for k in held if k[1] in idle]
            rest = [k for k in held if not holders[k[1]]]
        if self.budget.concurrent_fills is None:
            busy = set(origin)
            for k in rest:
                if k[1] not in busy:
                    busy.add(k[1])
                    wake.append(k)
        else:
            wake += rest[: max(self.budget.concurrent_fills - len(origin), 0)]
        for key in wake:
            if key in self.held:
                self.held.discard(key)
                self.failed_views.pop(key, None)
                self.dirty.add(model_of(key[1]))

    def resource(self, fill: Fill) -> None:
        """The fill's peer went away: go on with the rest from another source."""
        old = self.net.remove(fill.transfer)
        done = int(old.done) if old else 0
        fill.fetched[fill.kind] += done
        self.by_transfer.pop(fill.transfer, None)
        fill.source = self._source(fill.node, fill.revision)
        t = self.net.start(fill.node, fill.revision, fill.source, max(fill.size - done, 1))
        fill.transfer = t.id
        self.by_transfer[t.id] = fill

    def space_changed(self, node: str) -> None:
        """Warm-ups this node refused for room may fit now: let the planner retry them."""
        for key in [
            k for k, v in self.failed_views.items() if k[0] == node and v.state == "failed"
        ]:
            del self.failed_views[key]
            self.dirty.add(model_of(key[1]))

    def pins_freed(self, node: str) -> None:
        """A pinned copy left this node: the revisions it held out (``unfit`` and
        ``short_of_room``) may fit now: let the planner warm them again."""
        for key in [
            k
            for k, v in self.failed_views.items()
            if k[0] == node and v.state == "unfit" and v.short_of_room
        ]:
            del self.failed_views[key]
            self.dirty.add(model_of(key[1]))

    def cancel_fill(self, fill: Fill) -> None:
        self.net.remove(fill.transfer)
        self.by_transfer.pop(fill.transfer, None)
        self.fills.pop((fill.node, fill.revision), None)
        node = self.nodes.get(fill.node)
        if node is not None:
            node.release(fill.revision)
            self.space_changed(node.name)
        self.origin_freed()


def unfit_view(got: Refusal) -> CacheView:
    """The planner's view of a permanent refusal: ``unfit``, for good when the disk itself
    is too small (``retry_at`` 0), else until a pinned copy leaves (``pins_freed``)."""
    if got.for_good:
        return CacheView("unfit", reason=got.reason)
    return CacheView("unfit", reason=got.reason, retry_at=_NEVER, short_of_room=True)
