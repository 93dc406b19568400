"""``NodeStore``: a node's content-addressed model store (see docs/cache.md).

The facade over the store's parts: ``store.pull`` (resolve, reserve, fill, publish),
``store.space`` (usage, reservations, eviction execution), ``store.db`` (the metadata
repository: every SQL statement) and ``store.verify`` (re-hash, clean ``tmp/``). Several
processes may share one store: metadata lives in sqlite, fills of the same blob are
serialised by a per-blob file lock, and every visible file is complete and verified.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

from preheat.artifacts.manifest import Manifest
from preheat.errors import CacheError, ConfigError, SnapshotInUse, SnapshotNotFound
from preheat.sources.base import open_source, source_identity
from preheat.store import revoke as _revoke
from preheat.store.db import Db
from preheat.store.db_tx import Tx
from preheat.store.evict import EvictionPlan, SnapshotInfo, eviction_order
from preheat.store.fill import DEFAULT_CHUNK, RateLimiter
from preheat.store.layout import Layout
from preheat.store.pull import Puller
from preheat.store.pull_options import Progress, PullOptions
from preheat.store.repair import check_snapshot
from preheat.store.results import PullResult, Usage, VerifyReport
from preheat.store.revoke import RevokeReport
from preheat.store.space import Space, empty_trash
from preheat.store.verify import clean_tmp, verify

__all__ = ["NodeStore", "Progress", "PullResult", "Usage", "VerifyReport"]


class NodeStore:
    """A node's model store rooted at ``root``.

    ``capacity`` (bytes) bounds what the store may hold; fills keep usage under
    ``capacity * high_watermark``. Without a capacity only the disk's free space bounds it.
    """

    def __init__(
        self,
        root: Path | str,
        capacity: int | None = None,
        high_watermark: float = 0.9,
        *,
        fsync: bool = True,
        retries: int = 5,
        backoff: float = 0.2,
    ) -> None:
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"capacity {capacity} must be a positive byte count")
        if not 0 < high_watermark <= 1:
            raise ConfigError(f"high_watermark {high_watermark} must be in (0, 1], e.g. 0.9")
        self.root = Path(root).absolute()
        self.capacity = capacity
        self.high_watermark = high_watermark
        self.fsync = fsync
        self.retries = retries
        self.backoff = backoff
        self.layout = Layout(self.root)
        try:
            self.layout.ensure()
            self._db = Db(self.layout.db)
        except (OSError, sqlite3.Error) as exc:
            raise CacheError(
                f"cannot use {self.root} as a store: {exc}; pass a writable directory"
            ) from exc
        self._space = Space(self._db, self.layout, capacity, high_watermark)
        self._puller = Puller(
            self._db, self.layout, self._space, fsync=fsync, retries=retries, backoff=backoff
        )

    # --- pulling ------------------------------------------------------------------------

    def pull(
        self,
        ref: str,
        *,
        endpoint_url: str | None = None,
        rate_limit: float | None = None,
        connections: int = 8,
        progress: Progress | None = None,
        chunk: int = DEFAULT_CHUNK,
        revision: str | None = None,
        spare: frozenset[str] = frozenset(),
    ) -> PullResult:
        """Resolve ``ref``, fetch what is missing, publish a verified snapshot (blocking).

        ``rate_limit`` caps bytes/s over all connections; ``chunk`` is the size of one
        ranged request (and the unit a resumed fill skips). With ``revision``, the pull
        fails with ``RevisionChanged`` before fetching anything if ``ref`` now resolves
        to a different revision (an endpoint pins the revision it resolved once).
        ``spare``: snapshots this fill's eviction must not take (``store.space``)."""
        coro = self.apull(ref, endpoint_url=endpoint_url, rate_limit=rate_limit,
                          connections=connections, progress=progress, chunk=chunk,
                          revision=revision, spare=spare)  # fmt: skip
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            return asyncio.run(coro)

    async def apull(
        self,
        ref: str,
        *,
        endpoint_url: str | None = None,
        rate_limit: float | None = None,
        connections: int = 8,
        progress: Progress | None = None,
        chunk: int = DEFAULT_CHUNK,
        revision: str | None = None,
        peers: Any = None,
        origin_limiter: RateLimiter | None = None,
        spare: frozenset[str] = frozenset(),
    ) -> PullResult:
        """``pull`` for callers that already run an event loop; ``peers`` (a
        ``sources.peer.PeerFill``) fetches pieces from peers first, ``origin_limiter``
        caps the origin bytes/s shared with other pulls (``docs/peers.md``)."""
        opts = PullOptions(rate_limit, connections, progress, chunk, peers, origin_limiter,
                           frozenset(spare))  # fmt: skip
        return await self._puller.apull(ref, opts, endpoint_url=endpoint_url, revision=revision)

    # --- space --------------------------------------------------------------------------

    def usage(self) -> Usage:
        return self._space.usage()

    def free_bytes(self) -> int:
        """Bytes a new fill may use now without evicting anything."""
        return self.usage().free

    def plan_eviction(self, free_bytes: int) -> EvictionPlan:
        """A plan that frees ``free_bytes`` (priority, then least recent use; never pinned
        or leased snapshots, never blobs a fill in flight needs)."""
        return self._space.plan(free_bytes)

    def execute(self, plan: EvictionPlan) -> EvictionPlan:
        """Carry out ``plan``; returns what was actually removed (pins and leases are
        re-checked, so a snapshot leased since planning is skipped)."""
        return self._space.execute(plan)

    def delete(self, manifest_digest: str) -> EvictionPlan:
        """Remove one snapshot and the blobs only it used; refuses a leased snapshot."""
        trash: list[Path] = []
        try:
            return self._delete(manifest_digest, trash)
        finally:
            empty_trash(trash)

    def _delete(self, manifest_digest: str, trash: list[Path]) -> EvictionPlan:
        with self._db.write() as tx:
            d = self._require(tx, manifest_digest)
            holders = tx.holders(d)
            if holders:
                raise SnapshotInUse(
                    f"snapshot {manifest_digest[:16]} is leased by {', '.join(holders)}; "
                    "release the leases first"
                )
            blobs = tx.snapshot_blobs(manifest_digest)
            tx.set_flag(manifest_digest, "pinned", 0)
            plan = EvictionPlan(0, (manifest_digest,), tuple(sorted(set(blobs))), 0)
            return self._space.execute_in(tx, plan, trash)

    # --- metadata -----------------------------------------------------------------------

    def _require(self, tx: Tx, key: str) -> str:
        """The snapshot digest for a manifest digest or revision, or SnapshotNotFound."""
        digest = tx.require(key)
        if digest is None:
            raise SnapshotNotFound(
                f"no snapshot {key!r} in {self.root}; list them with `preheat cache ls --store {self.root}`"
            )
        return digest

    def resolve(self, ref: str, *, endpoint_url: str | None = None) -> tuple[str, Manifest]:
        """What ``ref`` names now: (revision, manifest). Digests unknown at the origin are
        filled in from the store when this revision was pulled before."""

        async def go() -> tuple[str, Manifest]:
            src = open_source(ref, endpoint_url=endpoint_url)
            try:
                res = await src.resolve()
            finally:
                await src.aclose()
            known = self._puller.known_snapshot(source_identity(res.ref, endpoint_url), res)
            if known is not None:
                with self._db.read() as tx:
                    text = tx.manifest_json(known)
                assert text is not None
                return res.revision, Manifest.from_json(text)
            return res.revision, res.manifest.with_digests(self._puller.known_fingerprints(res))

        return asyncio.run(go())

    def has(self, key: str) -> bool:
        """True when a complete snapshot for this manifest digest or revision is present."""
        with self._db.read() as tx:
            digest = tx.require(key)
        return digest is not None and self.layout.snapshot(digest).is_dir()

    def snapshot_path(self, key: str) -> Path:
        with self._db.read() as tx:
            return self.layout.snapshot(self._require(tx, key))

    def manifest(self, key: str) -> Manifest:
        with self._db.read() as tx:
            text = tx.manifest_json(self._require(tx, key))
        assert text is not None
        return Manifest.from_json(text)

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot, most recently used first."""
        with self._db.read() as tx:
            return sorted(tx.infos(), key=lambda s: -s.last_use)

    def eviction_candidates(self) -> list[SnapshotInfo]:
        """Evictable snapshots in the order eviction would take them."""
        return eviction_order(self.snapshots())

    def lease(self, manifest_digest: str, holder: str) -> None:
        """Mark a snapshot as in use by ``holder`` (survives restarts; never evicted).

        First every blob is checked against the size, mtime and ctime recorded when the
        store linked it; one that changed (a replica wrote into its snapshot) is re-hashed
        and, if its bytes changed, fetched again from the origin, so one replica cannot
        poison the next. Raises ``CacheError`` when that is impossible."""
        if not holder:
            raise ConfigError("lease holder must be a non-empty name, e.g. 'replica-3'")
        with self._db.read() as tx:
            digest = self._require(tx, manifest_digest)
        check_snapshot(self._db, self.layout, digest)  # a replica may have written into it
        with self._db.write() as tx:
            tx.add_lease(self._require(tx, digest), holder, time.time())

    def release(self, manifest_digest: str, holder: str) -> bool:
        """Drop ``holder``'s lease; returns whether it held one."""
        with self._db.write() as tx:
            return tx.drop_lease(manifest_digest, holder)

    def release_holder(self, holder: str) -> int:
        """Drop every lease ``holder`` has (a replica that is gone); returns how many."""
        with self._db.write() as tx:
            return tx.drop_holder(holder)

    def leases(self, manifest_digest: str) -> list[str]:
        with self._db.read() as tx:
            return tx.holders(self._require(tx, manifest_digest))

    def pin(self, manifest_digest: str) -> None:
        self._set(manifest_digest, "pinned", 1)

    def unpin(self, manifest_digest: str) -> None:
        self._set(manifest_digest, "pinned", 0)

    def set_priority(self, manifest_digest: str, priority: int) -> None:
        """Higher priority snapshots are evicted later (ties: least recently used first)."""
        self._set(manifest_digest, "priority", int(priority))

    def _set(self, key: str, column: str, value: int) -> None:
        with self._db.write() as tx:
            tx.set_flag(self._require(tx, key), column, value)

    # --- housekeeping -------------------------------------------------------------------

    def clean_tmp(self, *, partial_max_age: float = 86400.0, work_max_age: float = 600.0) -> int:
        """Remove leftovers in ``tmp/``: snapshot work dirs and trash older than
        ``work_max_age`` s, and partial downloads nobody holds the lock of that were last
        touched more than ``partial_max_age`` s ago. Returns how many entries went."""
        return clean_tmp(self.layout, partial_max_age=partial_max_age, work_max_age=work_max_age)

    def verify(self, *, quarantine: bool = True, workers: int = 2) -> VerifyReport:
        """Re-hash every blob. Corrupt blobs move to ``quarantine/``; snapshots that use them
        are removed (pointers first) so the next pull fetches them again."""
        return verify(self._db, self.layout, self._space, quarantine=quarantine, workers=workers)

    # --- revocation (store/revoke.py: one list for images and models) ---------------------

    def revoke(self, key: str, reason: str = "") -> RevokeReport:
        """Put ``key`` on the revocation list and remove what the store holds of it."""
        return _revoke.revoke(self._db, self._space, key, reason)

    def unrevoke(self, key: str) -> bool:
        return _revoke.unrevoke(self._db, key)

    def revoked(self) -> dict[str, tuple[str, float]]:
        """key -> (reason, since) for everything on this store's revocation list."""
        return _revoke.revoked(self._db)
