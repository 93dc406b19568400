"""One local node's cache as the fleet uses it: a ``NodeStore`` plus the node's limits.

The fleet keys everything by the *revision* a source resolved to when the spec was
applied. A pull resolves the source again; if the origin now serves something else the
store refuses it with ``RevisionChanged`` before fetching a byte (the endpoint keeps what
it pinned; applying the spec again picks the new revision up). A node's downloads are
limited to its ``origin_bandwidth`` (from the origin and from peers: one link). A warm-up
admitted to the fleet's fan-out (``runtime.peering``) fills piece by piece, from peers
first, with the origin budget's shared token bucket on origin bytes.

A pull the fan-out sent to peers (every blob it lacks is held or being filled by
another node) may be given the revision's ``Resolution`` as the fleet pinned it: when
the origin cannot be reached (``OriginUnavailable``, even to resolve), the pull fills
from peers against that pinned manifest, every byte verified as from any origin. A
reachable origin that now serves another revision is still ``RevisionChanged``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from preheat.control.spec import NodeSpec
from preheat.errors import ControlError, OriginUnavailable, SnapshotNotFound
from preheat.sources.base import Resolution, open_source
from preheat.sources.peer import PeerFill
from preheat.sources.pieces import PIECE_SIZE
from preheat.store.fill import DEFAULT_CHUNK, RateLimiter
from preheat.store.pull_options import PullOptions
from preheat.store.results import PullResult
from preheat.store.store import NodeStore

__all__ = ["NodeCache", "PullOutcome", "resolve_source"]


@dataclass(frozen=True)
class PullOutcome:
    snapshot: Path
    manifest_digest: str
    bytes_fetched: int
    bytes_reused: int
    seconds: float
    #: Of ``bytes_fetched``, the bytes that came from peers (the rest: the origin).
    bytes_from_peers: int = 0

    @property
    def bytes_from(self) -> dict[str, int]:
        """Bytes per source (``origin``, ``peer``, ``cache``), as in a ``StartRecord``."""
        return {
            "origin": self.bytes_fetched - self.bytes_from_peers,
            "peer": self.bytes_from_peers,
            "cache": self.bytes_reused,
        }


async def resolve_source(source: str) -> tuple[str, int, int]:
    """(revision, total bytes, file count) of what ``source`` names now."""
    src = open_source(source)
    try:
        res = await src.resolve()
    finally:
        await src.aclose()
    return res.revision, res.manifest.total_size, len(res.manifest.files)


class NodeCache:
    """A node's store, opened lazily, with the node's bandwidth limit applied to pulls."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self._store: NodeStore | None = None
        self._pulls: dict[str, asyncio.Task[PullOutcome]] = {}

    @property
    def store(self) -> NodeStore:
        if self._store is None:
            raise ControlError(f"node {self.spec.name}: store is not open")
        return self._store

    @property
    def closed(self) -> bool:
        return self._store is None

    def open(self) -> None:
        self.spec.store.mkdir(parents=True, exist_ok=True)
        self._store = NodeStore(self.spec.store, capacity=self.spec.capacity)

    async def aclose(self) -> None:
        """Cancel fills still running (their partial files stay resumable) and close."""
        for task in self._pulls.values():
            task.cancel()
        for task in self._pulls.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pulls.clear()
        self._store = None

    def has(self, revision: str) -> bool:
        return self.store.has(revision)

    def snapshot_dir(self, revision: str) -> Path | None:
        if not self.store.has(revision):
            return None
        return self.store.snapshot_path(revision)

    def used_bytes(self) -> int:
        if self._store is None:
            return 0
        with contextlib.suppress(Exception):
            return self._store.usage().used
        return 0

    async def pull(
        self,
        source: str,
        revision: str,
        *,
        progress: Callable[[int, int], None] | None = None,
        peers: PeerFill | None = None,
        origin_limiter: RateLimiter | None = None,
        pinned: Resolution | None = None,
        spare: frozenset[str] = frozenset(),
    ) -> PullOutcome:
        """Fill ``revision`` from ``source``; concurrent pulls of one revision share a
        fill (the first one's options hold). With ``peers`` the fill takes pieces from
        peers first (``sources.peer``); with ``pinned`` too, an unreachable origin leaves
        the peers (module docstring); ``spare``: snapshots its eviction must not take (a
        warm-up's unused warmed copies, ``runtime.warm_room``)."""
        task = self._pulls.get(revision)
        if task is None or task.done():
            task = asyncio.create_task(
                self._pull(source, revision, progress, peers, origin_limiter, pinned, spare)
            )
            self._pulls[revision] = task
        return await asyncio.shield(task)

    async def _pull(
        self,
        source: str,
        revision: str,
        progress: Callable[[int, int], None] | None,
        peers: PeerFill | None,
        origin_limiter: RateLimiter | None,
        pinned: Resolution | None,
        spare: frozenset[str],
    ) -> PullOutcome:
        # The store resolves first and refuses (RevisionChanged) before any byte moves
        # when the origin no longer serves the pinned revision.
        chunk = PIECE_SIZE if peers is not None else DEFAULT_CHUNK
        try:
            result = await self.store.apull(
                source,
                rate_limit=self.spec.origin_bandwidth,
                progress=progress,
                revision=revision,
                peers=peers,
                origin_limiter=origin_limiter,
                chunk=chunk,
                spare=spare,
            )
        except OriginUnavailable:
            if peers is None or pinned is None or pinned.revision != revision:
                raise
            if pinned.ref.scheme == "oci":  # its layer listings live in the store's binding
                raise
            opts = PullOptions(
                self.spec.origin_bandwidth, 8, progress, chunk, peers, origin_limiter, spare
            )
            result = await self._pull_pinned(pinned, opts)
        return PullOutcome(
            result.snapshot,
            result.manifest_digest,
            result.bytes_fetched,
            result.bytes_reused,
            result.seconds,
            bytes_from_peers=peers.peer_bytes if peers is not None else 0,
        )

    async def _pull_pinned(self, pinned: Resolution, opts: PullOptions) -> PullResult:
        """Fill the pinned resolution (the origin is down; peers hold or seed its blobs).
        ``Puller._pull_resolved`` is the store's fill after its resolve step, as
        ``images.cache`` uses it; any piece no peer delivers still goes to the origin."""
        opts.check()
        src = open_source(pinned.ref, connections=opts.connections)
        try:
            puller = self.store._puller
            return await puller._pull_resolved(
                pinned.ref, pinned, src, time.monotonic(), opts, None
            )
        finally:
            await src.aclose()

    def lease(self, revision: str, holder: str) -> tuple[str, str]:
        digest = self.store.snapshot_path(revision).name
        self.store.lease(digest, holder)
        return (digest, holder)

    def release(self, token: tuple[str, str]) -> None:
        self.store.release(*token)

    def pin(self, revision: str, priority: int) -> None:
        self.store.pin(revision)
        if priority:
            self.store.set_priority(revision, priority)

    def delete(self, revision: str) -> int:
        """Drop the revision's snapshot and the blobs only it used; bytes freed."""
        try:
            digest = self.store.snapshot_path(revision).name
        except SnapshotNotFound:
            return 0
        plan = self.store.delete(digest)
        return plan.frees
