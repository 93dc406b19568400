"""Downloads in flight and how the bandwidth is shared (pure: virtual time only).

Every transfer moves one revision to one node, from the origin or from a peer node
that holds it, or one image to one node from the registry. Rates, recomputed whenever a transfer starts or ends:

1. A node's link (``node_bandwidth``, both directions) is split evenly between the
   transfers into it, and a peer's uplink evenly between the transfers it serves:
   each transfer's *cap* is the smaller of its shares.
2. Peer transfers run at their cap: they do not touch the origin.
3. Origin transfers share ``origin_bandwidth`` max-min fairly under their caps: each
   gets ``B / n`` unless its cap is lower, and what a capped transfer leaves is shared
   by the others (water-filling). This is the "fair share" of a bucket or a CDN edge
   that all nodes pull from at once. Image pulls share ``registry_bandwidth`` the same
   way (a registry is another such endpoint); both kinds share each node's link.

Bytes are advanced lazily: ``advance(now)`` moves every transfer on at the rates set
when the set of transfers last changed (recomputed once per instant, not per change).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["ORIGIN", "REGISTRY", "Network", "Transfer"]

ORIGIN = "origin"
REGISTRY = "registry"
_SHARED = (ORIGIN, REGISTRY)


@dataclass
class Transfer:
    id: int
    node: str
    revision: str
    source: str  # ORIGIN, REGISTRY or the name of the peer node
    total: int
    done: float = 0.0
    rate: float = 0.0

    @property
    def left(self) -> float:
        return max(0.0, self.total - self.done)


class Network:
    """The transfers in flight and their rates."""

    def __init__(
        self,
        *,
        origin_bandwidth: float,
        node_bandwidth: float,
        registry_bandwidth: float = 10e9 / 8,
    ) -> None:
        self.origin_bandwidth = origin_bandwidth
        self.node_bandwidth = node_bandwidth
        self.registry_bandwidth = registry_bandwidth
        self.transfers: dict[int, Transfer] = {}
        self.now = 0.0
        self.bytes_from: Counter[str] = Counter()  # origin / peer / registry -> bytes moved
        self._next_id = 0
        self._stale = False

    def advance(self, now: float) -> None:
        if self._stale:
            self._rates()
        dt = now - self.now
        if dt > 0:
            for t in self.transfers.values():
                t.done += min(t.left, t.rate * dt)
        self.now = max(self.now, now)

    def start(self, node: str, revision: str, source: str, total: int) -> Transfer:
        self._next_id += 1
        t = Transfer(self._next_id, node, revision, source, total)
        self.transfers[t.id] = t
        self._stale = True
        return t

    def remove(self, tid: int) -> Transfer | None:
        """Take a transfer out (finished or cancelled); its bytes so far are counted."""
        t = self.transfers.pop(tid, None)
        self._stale = True
        if t is not None:
            if t.left <= 1.0:
                t.done = t.total
            self.bytes_from[kind(t.source)] += round(t.done)
        return t

    def next_finish(self) -> tuple[float, int] | None:
        """When the first transfer completes at the current rates, and which."""
        if self._stale:
            self._rates()
        best: tuple[float, int] | None = None
        for t in self.transfers.values():
            if t.left <= 0.5:
                eta = self.now
            elif t.rate > 0:
                eta = self.now + t.left / t.rate
            else:
                continue
            if best is None or (eta, t.id) < best:
                best = (eta, t.id)
        return best

    def uploads(self, node: str) -> int:
        return sum(1 for t in self.transfers.values() if t.source == node)

    def _rates(self) -> None:
        self._stale = False
        into = Counter(t.node for t in self.transfers.values())
        out = Counter(t.source for t in self.transfers.values() if t.source not in _SHARED)
        pools: dict[str, list[tuple[float, Transfer]]] = {ORIGIN: [], REGISTRY: []}
        for t in self.transfers.values():
            cap = self.node_bandwidth / into[t.node]
            if t.source in pools:
                pools[t.source].append((cap, t))
            else:
                t.rate = min(cap, self.node_bandwidth / out[t.source])
        # Water-filling of the origin's and the registry's links under the per-transfer caps.
        for source, bandwidth in (
            (ORIGIN, self.origin_bandwidth),
            (REGISTRY, self.registry_bandwidth),
        ):
            shared = pools[source]
            left = bandwidth
            shared.sort(key=lambda ct: ct[0])
            for i, (cap, t) in enumerate(shared):
                share = left / (len(shared) - i)
                t.rate = min(cap, share)
                left -= t.rate


def kind(source: str) -> str:
    """``origin``, ``registry`` or ``peer``: where a transfer's bytes are counted."""
    return source if source in _SHARED else "peer"
