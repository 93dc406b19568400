"""Warm-up as a fan-out: who fetches from the origin, who from peers, who waits (pure).

A rollout asks many nodes to warm the same revision at once. Fetching N copies from the
origin (S3, a Hub, an HTTP server) multiplies its load by N; peers that already hold the
bytes can carry most of it (Dragonfly's back-to-source seed plus piece exchange,
Spegel's node-local mirrors). The planner here decides, for every pending warm-up:

``PEER``
    Every blob the node lacks has a *complete* holder among the other up nodes, or a
    *filling seed* (``filling``: an up node whose origin fill of that blob is running):
    the node fetches its pieces from peers (several at once, ranked by ``rank_peers``),
    waiting for a seed's pieces to land (``sources.peer``: the origin only if the seed
    stalls). A peer that fails or serves wrong bytes costs a retry from another peer,
    then the origin, never a failed warm-up.
``ORIGIN``
    Some blob has no complete holder and the **cluster-wide origin budget** has room:
    the node fills from the origin (pieces that peers do hold still come from peers).
``WAIT``
    The budget is spent and no seed fills what the node lacks: the node waits for a
    holder or seed (then it becomes ``PEER``) or for an origin slot (a seed that failed frees its slot, so nobody waits forever).

The budget (``Budget``): ``concurrent_fills`` origin fills at once over the cluster;
``None`` (the default, no budget configured) means one origin fill per revision, so N
nodes warming one revision fetch about one copy from the origin and the rest from
peers. ``bandwidth`` (bytes/s over every origin fill) is enforced by the fill's shared
token bucket, not here.

Across processes (Kubernetes node agents) the origin budget's slots are named objects
(``origin_slot_names``: one per slot of ``concurrent_fills``, or one per revision without
a budget) that a holder renews; ``pick_slot`` chooses which one a warm-up claims (its
own, else the first free or expired one) and ``slot_holders`` turns the live ones into
the ``running`` of ``plan_fanout``.

Order is deterministic: requests are taken by (revision, node name); ranking ties are
broken by rendezvous hashing of (key, peer), so concurrent pieces of one blob spread
over different peers without coordination and every caller computes the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from preheat.artifacts.manifest import revision_hex

__all__ = [
    "Budget",
    "Candidate",
    "Mode",
    "Slot",
    "WarmRequest",
    "origin_slot_names",
    "pick_slot",
    "plan_fanout",
    "rank_peers",
    "slot_holders",
]


class Mode(StrEnum):
    ORIGIN = "origin"
    PEER = "peer"
    WAIT = "wait"


@dataclass(frozen=True)
class Budget:
    """Cluster-wide origin budget (``origin.budget`` in the cluster file)."""

    #: Origin fills running at once over the cluster; ``None``: one per revision.
    concurrent_fills: int | None = None
    #: Origin bytes/s over every fill at once; ``None``: unlimited.
    bandwidth: int | None = None

    def __post_init__(self) -> None:
        if self.concurrent_fills is not None and self.concurrent_fills < 1:
            raise ValueError(f"Budget.concurrent_fills {self.concurrent_fills} must be >= 1")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"Budget.bandwidth {self.bandwidth} must be > 0 bytes/s")


@dataclass(frozen=True)
class WarmRequest:
    """A node that wants ``revision`` and lacks the blobs ``missing`` (sha256 digests)."""

    node: str
    revision: str
    missing: frozenset[str]


def plan_fanout(
    requests: Iterable[WarmRequest],
    complete: Mapping[str, frozenset[str]],
    running: Iterable[tuple[str, str]],
    budget: Budget,
    filling: Mapping[str, frozenset[str]] | None = None,
) -> dict[tuple[str, str], Mode]:
    """``(node, revision) -> Mode`` for each request.

    ``complete``: up node -> the blobs it holds complete and verified; ``filling``: up
    node -> the blobs its running origin fill is fetching (a seed that serves the pieces
    it has landed); a blob counts for ``PEER`` when another node holds or fills it.
    ``running``: (node, revision) of origin fills in flight, which keep their slot (a
    request among them stays ``ORIGIN``).
    """
    filling = filling or {}
    running = sorted(set(running))
    per_revision: dict[str, int] = {}
    for _, rev in running:
        per_revision[rev] = per_revision.get(rev, 0) + 1
    total = len(running)
    out: dict[tuple[str, str], Mode] = {}
    for req in sorted(set(requests), key=lambda r: (r.revision, r.node)):
        key = (req.node, req.revision)
        if key in out:
            continue
        if key in running:
            out[key] = Mode.ORIGIN
            continue
        others = [blobs for node, blobs in complete.items() if node != req.node]
        others += [blobs for node, blobs in filling.items() if node != req.node]
        if all(any(d in blobs for blobs in others) for d in req.missing):
            out[key] = Mode.PEER
            continue
        if budget.concurrent_fills is None:
            room = per_revision.get(req.revision, 0) < 1
        else:
            room = total < budget.concurrent_fills
        if room:
            out[key] = Mode.ORIGIN
            per_revision[req.revision] = per_revision.get(req.revision, 0) + 1
            total += 1
        else:
            out[key] = Mode.WAIT
    return out


@dataclass(frozen=True)
class Candidate:
    """A peer that holds a piece: ``serving`` transfers in flight, ``complete`` whether
    it holds the whole blob (else only verified pieces of a fill in progress)."""

    name: str
    serving: int = 0
    complete: bool = True


def _weight(key: str, name: str) -> str:
    return hashlib.sha256(f"{key}\0{name}".encode()).hexdigest()


def rank_peers(
    candidates: Iterable[Candidate], key: str, avoid: frozenset[str] = frozenset()
) -> tuple[str, ...]:
    """Peers to try for one piece (``key`` names it, e.g. ``digest:index``), best first:
    least busy serving first, then rendezvous order of (key, peer); peers in ``avoid``
    (served wrong bytes, or failed this blob) are left out."""
    seen: dict[str, Candidate] = {}
    for c in candidates:
        if c.name not in avoid and c.name not in seen:
            seen[c.name] = c
    ranked = sorted(seen.values(), key=lambda c: (c.serving, _neg(_weight(key, c.name))))
    return tuple(c.name for c in ranked)


def _neg(hexdigest: str) -> str:
    """A key that sorts hex digests in descending order (highest random weight first)."""
    return hexdigest.translate(_FLIP)


_FLIP = str.maketrans("0123456789abcdef", "fedcba9876543210")


# --- origin slots shared by processes (Kubernetes Leases) ---------------------------------


@dataclass(frozen=True)
class Slot:
    """One origin slot as last read: ``holder`` (``node/revision``, None when free) and
    when it was last renewed (seconds) with its duration; past that it is expired."""

    name: str
    holder: str | None = None
    renewed: float | None = None
    duration: float = 15.0

    def live(self, now: float) -> bool:
        return self.holder is not None and (
            self.renewed is None or now < self.renewed + self.duration
        )


def origin_slot_names(
    budget: Budget, revision: str, prefix: str = "preheat-origin"
) -> tuple[str, ...]:
    """The slot names a warm-up of ``revision`` may claim: ``concurrent_fills`` cluster-wide
    slots (``<prefix>-0`` ...), or one slot of its own revision without a budget."""
    if budget.concurrent_fills is None:
        return (f"{prefix}-{revision_hex(revision)[:12]}",)
    return tuple(f"{prefix}-{i}" for i in range(budget.concurrent_fills))


def slot_holders(slots: Iterable[Slot], now: float) -> set[tuple[str, str]]:
    """(node, revision) of every live slot (the ``running`` of ``plan_fanout``)."""
    out = set()
    for s in slots:
        if s.live(now) and s.holder is not None:
            node, _, rev = s.holder.partition("/")
            out.add((node, rev))
    return out


def pick_slot(slots: Iterable[Slot], me: str, now: float) -> Slot | None:
    """The slot holder ``me`` should claim or renew: the one it already holds, else the
    first (by name) that is free or whose holder stopped renewing; None: all are taken."""
    ordered = sorted(slots, key=lambda s: s.name)
    for s in ordered:
        if s.holder == me:
            return s
    for s in ordered:
        if not s.live(now):
            return s
    return None
