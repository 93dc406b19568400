"""Pull orchestration: resolve, reserve, fill the missing blobs, publish, commit.

A pull resolves a ref to a revision and manifest, reserves space (evicting by plan if it
must, refusing before any download if even that is not enough), fetches only the blobs the
store lacks (``store.fill``), links a snapshot directory and commits its row
(``store.pull_publish``). Fills of the same blob by several pullers are serialised by a
per-blob file lock, and every visible file is complete and verified. ``PullOptions`` is
``store.pull_options``; failures are reported as ``store.pull_failures`` describes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from preheat.artifacts.manifest import Manifest
from preheat.artifacts.refs import ArtifactRef, parse_ref
from preheat.errors import CacheError, InsufficientSpace, RevisionChanged
from preheat.sources.base import Location, Resolution, open_source, source_identity
from preheat.store.db import Db
from preheat.store.fill import (
    FillContext,
    FillStats,
    RateLimiter,
    Slots,
    fetch_blob,
    fsync_dirs,
    lock_file,
    unlock_file,
)
from preheat.store.layout import Layout
from preheat.store.pull_failures import disk_full, one_error
from preheat.store.pull_options import PullOptions
from preheat.store.pull_publish import pause, publish_snapshot, record_ref
from preheat.store.repair import stat_of
from preheat.store.results import PullResult
from preheat.store.revoke import refuse_revoked, revoked
from preheat.store.space import Reservation, Space


@dataclass
class _Want:
    key: str
    size: int
    expected: str | None
    location: Location
    paths: list[str] = field(default_factory=list)


class Puller:
    """Pulls into one store (``NodeStore.apull`` delegates here)."""

    def __init__(
        self, db: Db, layout: Layout, space: Space, *, fsync: bool, retries: int, backoff: float
    ) -> None:
        self.db = db
        self.layout = layout
        self.space = space
        self.fsync = fsync
        self.retries = retries
        self.backoff = backoff

    async def apull(
        self,
        ref: str,
        opts: PullOptions,
        *,
        endpoint_url: str | None,
        revision: str | None,
    ) -> PullResult:
        opts.check()
        t0 = time.monotonic()
        r = parse_ref(ref)
        source = open_source(r, endpoint_url=endpoint_url, connections=opts.connections)
        bind = getattr(source, "bind_store", None)
        if bind is not None:  # oci://: tar-layer listings in the store, revoked layers early
            bind(self.layout, await asyncio.to_thread(revoked, self.db), self.space)
        try:
            res = await source.resolve()
            if revision is not None and res.revision != revision:
                raise RevisionChanged(
                    f"{r.display} now resolves to revision {res.revision}, not {revision}; "
                    "nothing was fetched (apply the spec again to move to the new revision)"
                )
            return await self._pull_resolved(r, res, source, t0, opts, endpoint_url)
        finally:
            await source.aclose()

    async def _pull_resolved(
        self,
        ref: ArtifactRef,
        res: Resolution,
        source: Any,
        t0: float,
        opts: PullOptions,
        endpoint_url: str | None,
    ) -> PullResult:
        """Every blocking step (sqlite with its busy wait, eviction, links, fsyncs) runs in
        a thread: the loop is shared with the fleet's controller and other warm-ups."""
        await asyncio.to_thread(refuse_revoked, self.db, ref, res)  # before any byte moves
        progress = opts.progress
        total = res.manifest.total_size
        source_id = source_identity(ref, endpoint_url)
        known = await asyncio.to_thread(self._hit, ref, res, source_id, endpoint_url)
        if known is not None:
            if progress is not None:
                progress(total, total)
            return PullResult(
                self.layout.snapshot(known), res.revision, known, 0, total, time.monotonic() - t0
            )
        manifest, wants, reservation = await asyncio.to_thread(
            self._prepare, ref, res, source, opts.spare
        )
        stats = FillStats(total=total)
        stats.reused = total - sum(w.size * len(w.paths) for w in wants.values())
        try:
            digests: dict[str, str] = {}
            if wants:
                digests = await self._fill(wants, source, stats, opts, reservation)
            digest = await asyncio.to_thread(
                self._finish,
                ref,
                res,
                manifest.with_digests(digests),
                set(digests.values()),
                source_id,
                endpoint_url,
                reservation,
            )
        except BaseException as exc:
            # the blobs it fetched stay (unprotected) for a later pull to reuse
            with contextlib.suppress(sqlite3.Error, OSError):  # a full disk may refuse it
                await asyncio.shield(asyncio.to_thread(self.space.release, reservation))
            if disk_full(exc):
                raise InsufficientSpace(
                    f"the disk under {self.layout.root} filled up while pulling {ref.display} "
                    f"(something else wrote to it after the space check: {exc}); the store "
                    "is consistent: nothing of this pull was published, verified blobs and "
                    "partial downloads in tmp/ are reused when the pull runs again"
                ) from exc
            raise
        if progress is not None:
            progress(total, total)
        return PullResult(
            snapshot=self.layout.snapshot(digest),
            revision=res.revision,
            manifest_digest=digest,
            bytes_fetched=stats.fetched,
            bytes_reused=stats.reused,
            seconds=time.monotonic() - t0,
            bytes_resumed=stats.resumed,
        )

    def _hit(
        self, ref: ArtifactRef, res: Resolution, source_id: str, endpoint_url: str | None
    ) -> str | None:
        """The snapshot digest when the store already holds this resolution (recorded)."""
        known = self.known_snapshot(source_id, res)
        if known is not None:
            with self.db.write() as tx:
                tx.touch(known)
                tx.record_revision(source_id, res, known, endpoint=endpoint_url)
            record_ref(self.layout, ref, res, known)
        return known

    def _prepare(
        self, ref: ArtifactRef, res: Resolution, source: Any, spare: frozenset[str]
    ) -> tuple[Manifest, dict[str, _Want], Reservation]:
        """Plan the fill and reserve its space (evicting if it must). A source with
        ``linked_bytes`` (``oci://``: tar members it staged in the store's tmp/) says how
        many of the wanted bytes are on the store's disk already, to be linked, not
        written: the disk's free space is not asked to hold those twice. ``spare``: the
        snapshots the reservation's eviction must not take (``Space.reserve``)."""
        linked = getattr(source, "linked_bytes", None)
        for _attempt in range(3):
            manifest, wants, present = self._plan(res)
            need = sum(w.size for w in wants.values())
            on_disk = 0
            if linked is not None:
                on_disk = linked({w.expected: w.size for w in wants.values() if w.expected})
            reservation = self.space.reserve(ref.text, need, present, on_disk=on_disk, spare=spare)
            if all(self.layout.blob(d).exists() for d in present):
                return manifest, wants, reservation
            # another process evicted a blob between our look and our reservation
            self.space.release(reservation)
        raise CacheError(
            f"cannot pull {ref.display}: blobs it shares with other snapshots keep being "
            "evicted by other processes; retry when the store is less busy"
        )

    def _finish(
        self,
        ref: ArtifactRef,
        res: Resolution,
        manifest: Manifest,
        fresh: set[str],
        source_id: str,
        endpoint_url: str | None,
        reservation: Reservation,
    ) -> str:
        """Link the snapshot, commit it and drop the reservation in one transaction."""
        pause("verify")
        digest = manifest.digest
        blobs = {f.sha256 for f in manifest.files if f.sha256 is not None}
        before = {b: stat_of(self.layout.blob(b)) for b in blobs}
        publish_snapshot(self.layout, manifest, digest, fsync=self.fsync)
        pause("commit")
        fingerprints = {f.path: res.locations[f.path].fingerprint for f in manifest.files}
        with self.db.write() as tx:
            tx.commit_snapshot(manifest, digest, fingerprints)
            for b in blobs:
                # linking moved the blob's ctime: record the new stat when the blob is one
                # this fill verified, or was unchanged since the store last recorded it
                after = stat_of(self.layout.blob(b))
                if after is not None and (b in fresh or before[b] == tx.blob_stat(b)):
                    tx.set_blob_stat(b, *after)
            tx.record_revision(source_id, res, digest, endpoint=endpoint_url)
            tx.drop_reservation(reservation.id)
        self.space.release(reservation, dropped=True)
        record_ref(self.layout, ref, res, digest)
        return digest

    def _plan(self, res: Resolution) -> tuple[Manifest, dict[str, _Want], set[str]]:
        """(manifest with known digests, blobs to fetch by key, blobs already present)."""
        manifest = res.manifest.with_digests(self.known_fingerprints(res))
        wants: dict[str, _Want] = {}
        present: set[str] = set()
        for f in manifest.files:
            if f.sha256 is not None and self.layout.blob(f.sha256).exists():
                present.add(f.sha256)
                continue
            loc = res.locations[f.path]
            key = f.sha256 or hashlib.sha256(loc.fingerprint.encode()).hexdigest()
            wants.setdefault(key, _Want(key, f.size, f.sha256, loc)).paths.append(f.path)
        return manifest, wants, present

    async def _fill(
        self,
        wants: dict[str, _Want],
        source: Any,
        stats: FillStats,
        opts: PullOptions,
        reservation: Reservation,
    ) -> dict[str, str]:
        """Fetch every wanted blob; returns manifest path -> sha256 for each."""
        progress = opts.progress
        executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="preheat-fill")
        ctx = FillContext(
            source=source,
            layout=self.layout,
            connections=Slots(opts.connections),
            executor=executor,
            stats=stats,
            limiter=RateLimiter(opts.rate_limit) if opts.rate_limit else None,
            fsync=self.fsync,
            chunk=opts.chunk,
            retries=self.retries,
            backoff=self.backoff,
            peers=opts.peers,
            origin_limiter=opts.origin_limiter,
        )
        files = asyncio.Semaphore(4)  # files hashed at once (one thread each)
        out: dict[str, str] = {}

        failures: dict[int, str] = {}  # id(exception) -> the file it failed

        errors: list[Exception] = []

        async def one(w: _Want, seq: int) -> None:
            # a failed file does not cancel the others: every failure is reported, and
            # what the others fetch is kept for the next pull
            try:
                await fetch(w, seq)
            except Exception as exc:
                failures[id(exc)] = w.paths[0]
                errors.append(exc)

        n_paths = sum(len(x.paths) for x in wants.values())  # once: a sum per blob was O(files^2)

        async def fetch(w: _Want, seq: int) -> None:
            async with files:
                lock = await lock_file(self.layout.tmp / f"{w.key}.lock")
                try:
                    digest = await asyncio.to_thread(self._already_there, w, reservation)
                    if digest is not None:
                        stats.reused += w.size * len(w.paths)
                    else:
                        digest = await fetch_blob(
                            ctx, w.paths[0], w.location, w.size, w.expected, w.key, seq
                        )
                        if not await asyncio.to_thread(
                            self.space.protect, reservation, digest, w.size, w.location.fingerprint
                        ):  # protected: a pause at "download" may keep it there
                            raise CacheError(
                                f"blob {digest[:16]} of {w.paths[0]!r} vanished right after "
                                "it was published; the store is being changed by hand?"
                            )
                finally:
                    unlock_file(lock)
            for p in w.paths:
                out[p] = digest
            if len(out) < n_paths:
                await asyncio.to_thread(pause, "download")

        async def report() -> None:
            assert progress is not None
            while True:
                progress(stats.done, stats.total)
                await asyncio.sleep(0.2)

        reporter = asyncio.create_task(report()) if progress is not None else None
        try:
            async with asyncio.TaskGroup() as tg:
                # biggest first keeps every connection busy to the end
                for seq, w in enumerate(sorted(wants.values(), key=lambda w: -w.size)):
                    tg.create_task(one(w, seq))
            if errors:
                raise BaseExceptionGroup("fill failed", errors)
            if ctx.dirty_dirs:
                await asyncio.get_running_loop().run_in_executor(
                    executor, fsync_dirs, ctx.dirty_dirs
                )
        except BaseExceptionGroup as eg:
            raise one_error(eg, failures) from None
        finally:
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
            executor.shutdown(wait=False)
        return out

    def _already_there(self, w: _Want, reservation: Reservation) -> str | None:
        """The digest if another puller published this blob while we waited for its lock
        (now protected by our reservation too)."""
        digest = w.expected
        if digest is None:
            with self.db.read() as tx:
                digest = tx.fingerprint_digest(w.location.fingerprint)
        if digest is None or not self.layout.blob(digest).exists():
            return None
        return (
            digest
            if self.space.protect(reservation, digest, w.size, w.location.fingerprint)
            else None
        )

    def known_fingerprints(self, res: Resolution) -> dict[str, str]:
        """path -> sha256 for files without a digest whose fingerprint was hashed before."""
        unknown = {
            f.path: res.locations[f.path].fingerprint
            for f in res.manifest.files
            if f.sha256 is None
        }
        if not unknown:
            return {}
        out = {}
        with self.db.read() as tx:
            for path, fp in unknown.items():
                digest = tx.fingerprint_digest(fp)
                if digest is not None and self.layout.blob(digest).exists():
                    out[path] = digest
        return out

    def known_snapshot(self, source_id: str, res: Resolution) -> str | None:
        """The snapshot this resolution names, when the store holds it.

        A hit needs the same (source identity, revision) *and* a manifest that agrees
        with the resolved one: the same digest when the origin lists every sha256, else
        the same paths and sizes and every sha256 the origin does list."""
        with self.db.read() as tx:
            row = tx.lookup(source_id, res.revision)
        if row is None:
            return None
        digest, text = row
        if not self.layout.snapshot(digest).is_dir():
            return None
        if res.manifest.complete:
            return digest if res.manifest.digest == digest else None
        stored = {f.path: f for f in Manifest.from_json(text).files}
        for f in res.manifest.files:
            have = stored.pop(f.path, None)
            if have is None or have.size != f.size:
                return None
            if f.sha256 is not None and f.sha256 != have.sha256:
                return None
        return None if stored else digest
