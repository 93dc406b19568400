"""The local fleet's peers: one blob server per node, who holds what, the origin budget.

``OriginGate`` is the origin budget alone (``peers: {enabled: false}``): every node
fills from the origin, a warm-up waits until ``control.fanout.plan_fanout`` gives it a
slot (holders are not peers here), and a replica's own pull on a cold node never waits
but holds a slot while it fills, so warm-ups yield the origin to starts (as in
``preheat sim coldstart``).

``FleetPeers`` (an ``OriginGate`` with peers) is what a warm-up asks before it fills (``admit``) and what its fill asks
for each piece (``candidates``, the ``sources.peer.PeerDirectory`` protocol):

- every node's store is served by its own ``store.peer_server.PeerServer`` on
  127.0.0.1 (its own port), started with the first warm-up; the **cluster token** is
  drawn at random when the fleet starts and held in memory only (never on a command
  line, in the fleet log, status or a metric);
- ``admit`` waits until ``control.fanout.plan_fanout`` gives the pull ``origin`` (a
  slot of the cluster-wide origin budget) or ``peer`` (every blob it lacks is complete
  on another up node, or being filled from the origin by one: a *seed*), and hands back
  the ``PeerFill`` for it; an origin fill keeps its slot until ``release``. Warm-ups
  and a replica's own pull on a cold node are admitted alike: a cold replica fills from
  peers first and takes an origin slot only when no node holds or seeds the revision;
- a ``peer`` fill waits for a seed's pieces to land (``seed_progress``; the origin
  only for pieces of a seed that lands nothing for ``seed_stall`` seconds) and carries
  the revision's ``Resolution`` as first resolved (``Admission.pinned``), so it can
  complete from peers while the origin is down (``runtime.nodestore``);
- ``candidates`` ranks the up nodes that hold a piece (published blob, or a verified
  piece of a fill in progress) with ``control.fanout.rank_peers``: least busy serving
  first; a peer that served bytes failing verification is avoided for the fleet's life;
- the origin budget's bytes/s is one token bucket shared by every origin fill.

Who holds a blob is read from the node stores' ``blobs/`` (a stat) and the nodes'
``PieceBook``s: in one process that is the truth; Kubernetes node agents learn it from
``NodeCache`` objects and ask the peer's ``/pieces`` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from preheat.control.fanout import Budget, Candidate, Mode, WarmRequest, plan_fanout, rank_peers
from preheat.sources.base import Resolution, open_source
from preheat.sources.peer import PeerClient, PeerFill
from preheat.sources.pieces import PieceBook
from preheat.store.fill import RateLimiter
from preheat.store.layout import Layout
from preheat.store.peer_server import PeerServer

__all__ = ["Admission", "FleetPeers", "OriginGate", "resolve_blobs"]

_POLL = 0.25  # seconds between looks while a warm-up waits for a seed or a slot


async def _resolve(source: str) -> Resolution:
    src = open_source(source)
    try:
        return await src.resolve()
    finally:
        await src.aclose()


def _digests(res: Resolution) -> frozenset[str]:
    return frozenset(f.sha256 for f in res.manifest.files if f.sha256 is not None)


async def resolve_blobs(source: str) -> tuple[str, frozenset[str]]:
    """The revision ``source`` names now and the sha256 digests of the blobs its manifest
    lists (the blobs a peer may serve; files without a sha256 come from the origin only)."""
    res = await _resolve(source)
    return res.revision, _digests(res)


@dataclass
class _Member:
    server: PeerServer
    book: PieceBook


@dataclass
class Admission:
    """A warm-up's place in the fan-out: how it fills, and the fill's peer side."""

    mode: Mode
    fill: PeerFill
    origin_limiter: RateLimiter | None
    #: The revision as first resolved, for a ``peer`` fill (None for an origin fill).
    pinned: Resolution | None = None


class OriginGate:
    """The cluster-wide origin budget without peers (see the module docstring)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        #: (node, revision) of origin fills running (warm-ups and replicas' own pulls).
        self._running: set[tuple[str, str]] = set()
        self._waiting: set[tuple[str, str]] = set()
        self._changed = asyncio.Event()
        self.origin_limiter = RateLimiter(budget.bandwidth) if budget.bandwidth else None

    @property
    def running(self) -> frozenset[tuple[str, str]]:
        """(node, revision) of the origin fills holding a slot now."""
        return frozenset(self._running)

    def _why(self, what: str = "an origin slot") -> str:
        return f"waiting for {what} ({len(self._running)} origin fill(s) running)"

    async def _changes(self) -> None:
        """Return when something changed, or after ``_POLL`` seconds."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), _POLL)

    async def admit_origin(
        self, node: str, revision: str, on_wait: Callable[[str], None], *, wait: bool = True
    ) -> None:
        """Take an origin slot for this fill, waiting for one (``wait``: a warm-up) or
        taking it at once, over the budget if need be (a replica's own pull)."""
        key = (node, revision)
        if not wait:
            self._running.add(key)
            return
        try:
            while True:
                self._waiting.add(key)
                requests = [WarmRequest(n, r, frozenset({r})) for n, r in self._waiting]
                if plan_fanout(requests, {}, self._running, self.budget)[key] is Mode.ORIGIN:
                    self._running.add(key)
                    return
                on_wait(self._why())
                await self._changes()
        finally:
            self._waiting.discard(key)

    def release(self, node: str, revision: str) -> None:
        """A fill ended (either way): its origin slot, if any, is free again."""
        self._running.discard((node, revision))
        self._changed.set()

    def wake(self) -> None:
        """Something changed (a blob was published): waiting warm-ups look again."""
        self._changed.set()


class FleetPeers(OriginGate):
    """See the module docstring. ``nodes()`` gives name -> (store layout, up) now."""

    def __init__(
        self,
        budget: Budget,
        nodes: Callable[[], dict[str, tuple[Layout, bool]]],
        say: Callable[[str], None],
        *,
        seed_stall: float = 20.0,
    ) -> None:
        super().__init__(budget)
        #: Seconds a ``peer`` fill waits for a seed that lands no piece (then: origin).
        self.seed_stall = seed_stall
        #: Whether a seed still filling counts as a source (False: receivers wait for a
        #: complete holder, as before; ``benchmarks/peer_warmup.py`` compares the two).
        self.seed_sources = True
        self._nodes = nodes
        self._say = say
        self._token = secrets.token_urlsafe(32)
        self._client = PeerClient(self._token)
        self._members: dict[str, _Member] = {}
        self._pending: dict[tuple[str, str], frozenset[str]] = {}
        self._blobs: dict[str, frozenset[str]] = {}
        self._resolutions: dict[str, Resolution] = {}
        #: (node, revision) of origin fills running -> the blobs they fetch (seeds).
        self._filling: dict[tuple[str, str], frozenset[str]] = {}
        self._start_lock = asyncio.Lock()
        #: peer -> why it is avoided (it served bytes that failed verification).
        self.avoided: dict[str, str] = {}

    # --- servers --------------------------------------------------------------------

    async def ensure_servers(self) -> None:
        """A peer server for every node that has none yet (nodes may join later)."""
        async with self._start_lock:
            for name, (layout, _up) in self._nodes().items():
                if name not in self._members:
                    book = PieceBook()
                    server = PeerServer(layout, self._token, book)
                    await server.start()
                    self._members[name] = _Member(server, book)

    def server(self, node: str) -> PeerServer | None:
        m = self._members.get(node)
        return m.server if m is not None else None

    async def aclose(self) -> None:
        for m in self._members.values():
            with contextlib.suppress(Exception):
                await m.server.stop()
        self._members.clear()
        await self._client.aclose()

    # --- admission ------------------------------------------------------------------

    async def blobs_of(self, revision: str, source: str) -> frozenset[str]:
        """The sha256 digests a revision's manifest lists (resolved once per revision)."""
        known = self._blobs.get(revision)
        if known is None:
            res = await _resolve(source)
            if res.revision == revision:
                self._resolutions[revision] = res
            known = self._blobs[revision] = _digests(res)
        return known

    def _seeds(self) -> dict[str, frozenset[str]]:
        """Up node -> the blobs its running origin fills fetch."""
        nodes = self._nodes()
        out: dict[str, frozenset[str]] = {}
        for (name, _), blobs in self._filling.items():
            if name in nodes and nodes[name][1]:
                out[name] = out.get(name, frozenset()) | blobs
        return out

    def _complete(self, digests: frozenset[str]) -> dict[str, frozenset[str]]:
        out = {}
        for name, (layout, up) in self._nodes().items():
            if up and name in self._members:
                out[name] = frozenset(d for d in digests if layout.blob(d).exists())
        return out

    async def admit(
        self, node: str, revision: str, source: str, on_wait: Callable[[str], None]
    ) -> Admission:
        """Wait for this warm-up's turn in the fan-out (see the module docstring)."""
        await self.ensure_servers()
        blobs = await self.blobs_of(revision, source)
        key = (node, revision)
        layout = self._nodes()[node][0]
        try:
            while True:
                missing = frozenset(d for d in blobs if not layout.blob(d).exists())
                self._pending[key] = missing
                requests = [WarmRequest(n, r, m) for (n, r), m in self._pending.items()]
                wanted = frozenset().union(*self._pending.values())
                seeds = self._seeds() if self.seed_sources else None
                plan = plan_fanout(
                    requests, self._complete(wanted), self._running, self.budget, seeds
                )
                mode = plan[key]
                if mode is Mode.ORIGIN:
                    self._running.add(key)
                    self._filling[key] = missing
                if mode is not Mode.WAIT:
                    peer = mode is Mode.PEER
                    fill = PeerFill(
                        self._client,
                        self,
                        node,
                        self._members[node].book,
                        wait_for_seeds=peer,
                        seed_stall=self.seed_stall,
                    )
                    pinned = self._resolutions.get(revision) if peer else None
                    return Admission(mode, fill, self.origin_limiter, pinned)
                on_wait(self._why("a peer to hold the model or an origin slot"))
                await self._changes()
        finally:
            self._pending.pop(key, None)

    def release(self, node: str, revision: str) -> None:
        """A warm-up ended (either way): its origin slot, if any, is free again."""
        self._filling.pop((node, revision), None)
        super().release(node, revision)

    # --- PeerDirectory --------------------------------------------------------------

    def candidates(self, digest: str, index: int, receiver: str) -> list[tuple[str, str]]:
        nodes = self._nodes()
        found: list[Candidate] = []
        for name, m in self._members.items():
            if name == receiver or name not in nodes or not nodes[name][1]:
                continue
            layout = nodes[name][0]
            if layout.blob(digest).exists():
                found.append(Candidate(name, m.server.serving, True))
                continue
            partial = m.book.get(digest)
            if partial is not None and index in partial.verified:
                found.append(Candidate(name, m.server.serving, False))
        ranked = rank_peers(found, f"{digest}:{index}", frozenset(self.avoided))
        return [(n, self._members[n].server.url) for n in ranked]

    def seed_progress(self, digest: str, receiver: str) -> dict[str, int]:
        """``sources.peer.SeedDirectory``: up nodes filling ``digest`` from the origin now
        (not yet published there), each with its pieces landed so far."""
        nodes = self._nodes()
        out: dict[str, int] = {}
        for name, blobs in self._seeds().items():
            m = self._members.get(name)
            if name == receiver or m is None or digest not in blobs:
                continue
            if nodes[name][0].blob(digest).exists():
                continue  # published: a complete holder (``candidates``)
            partial = m.book.get(digest)
            out[name] = len(partial.verified) if partial is not None else 0
        return out

    def avoid(self, peer: str, why: str) -> None:
        if peer not in self.avoided:
            self.avoided[peer] = why
            self._say(f"avoiding peer {peer}: {why}")
