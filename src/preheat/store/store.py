"""``NodeStore``: a node's content-addressed model store (see DESIGN.md, "Node store on disk").

A pull resolves a ref to a revision and manifest, reserves space (evicting by plan if it
must, refusing before any download if even that is not enough), fetches only the blobs the
store lacks, verifies and publishes them, links a snapshot directory and commits its row.
Several processes may share one store: metadata lives in sqlite, fills of the same blob
are serialised by a per-blob file lock, and every visible file is complete and verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preheat.artifacts.manifest import Manifest
from preheat.artifacts.refs import ArtifactRef, parse_ref
from preheat.config import format_size
from preheat.errors import (
    CacheError,
    ConfigError,
    InsufficientSpace,
    RevisionChanged,
    SnapshotInUse,
    SnapshotNotFound,
)
from preheat.sources.base import Location, Resolution, open_source
from preheat.store.db import Db
from preheat.store.evict import EvictionPlan, SnapshotInfo, eviction_order, plan_eviction
from preheat.store.fill import (
    DEFAULT_CHUNK,
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

# progress(done_bytes, total_bytes), called from the pull's event loop about 5 times a second.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PullResult:
    snapshot: Path
    revision: str
    manifest_digest: str
    bytes_fetched: int
    bytes_reused: int
    seconds: float
    bytes_resumed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "snapshot": str(self.snapshot),
            "revision": self.revision,
            "manifest_digest": self.manifest_digest,
            "bytes_fetched": self.bytes_fetched,
            "bytes_reused": self.bytes_reused,
            "bytes_resumed": self.bytes_resumed,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class Usage:
    capacity: int | None
    high_watermark: float
    used: int
    reserved: int
    disk_free: int
    free: int


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    bytes: int
    corrupt: tuple[tuple[str, str], ...]  # (expected digest, actual digest)
    removed_snapshots: tuple[str, ...]
    missing_snapshots: tuple[str, ...]
    seconds: float
    cleaned_tmp: int = 0

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.missing_snapshots


@dataclass
class _Want:
    key: str
    size: int
    expected: str | None
    location: Location
    paths: list[str] = field(default_factory=list)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    ) -> PullResult:
        """Resolve ``ref``, fetch what is missing, publish a verified snapshot (blocking).

        ``rate_limit`` caps bytes/s over all connections; ``chunk`` is the size of one
        ranged request (and the unit a resumed fill skips). With ``revision``, the pull
        fails with ``RevisionChanged`` before fetching anything if ``ref`` now resolves
        to a different revision (an endpoint pins the revision it resolved once)."""
        coro = self.apull(
            ref,
            endpoint_url=endpoint_url,
            rate_limit=rate_limit,
            connections=connections,
            progress=progress,
            chunk=chunk,
            revision=revision,
        )
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
    ) -> PullResult:
        """``pull`` for callers that already run an event loop."""
        if connections < 1:
            raise ConfigError(f"connections {connections} must be >= 1")
        if chunk < 64 << 10:
            raise ConfigError(f"chunk size {chunk} is below 64 KiB; use e.g. 32MiB")
        if rate_limit is not None and rate_limit <= 0:
            raise ConfigError(f"rate_limit {rate_limit} must be > 0 bytes/s (or None)")
        t0 = time.monotonic()
        r = parse_ref(ref)
        source = open_source(r, endpoint_url=endpoint_url, connections=connections)
        try:
            res = await source.resolve()
            if revision is not None and res.revision != revision:
                raise RevisionChanged(
                    f"{ref} now resolves to revision {res.revision}, not {revision}; "
                    "nothing was fetched (apply the spec again to move to the new revision)"
                )
            return await self._pull_resolved(
                r, res, source, t0, rate_limit, connections, progress, chunk
            )
        finally:
            await source.aclose()

    async def _pull_resolved(
        self,
        ref: ArtifactRef,
        res: Resolution,
        source: Any,
        t0: float,
        rate_limit: float | None,
        connections: int,
        progress: Progress | None,
        chunk: int,
    ) -> PullResult:
        total = res.manifest.total_size
        known = self._digest_for_revision(res.revision)
        if known is not None:
            self._touch(known)
            self._record_ref(ref, res.revision, known)
            if progress is not None:
                progress(total, total)
            return PullResult(
                self.layout.snapshot(known), res.revision, known, 0, total, time.monotonic() - t0
            )
        manifest = res.manifest.with_digests(self._known_fingerprints(res))
        wants: dict[str, _Want] = {}
        present: set[str] = set()
        for f in manifest.files:
            if f.sha256 is not None and self.layout.blob(f.sha256).exists():
                present.add(f.sha256)
                continue
            loc = res.locations[f.path]
            key = f.sha256 or hashlib.sha256(loc.fingerprint.encode()).hexdigest()
            wants.setdefault(key, _Want(key, f.size, f.sha256, loc)).paths.append(f.path)
        need = sum(w.size for w in wants.values())
        reservation = self._reserve(ref.text, need, present)
        stats = FillStats(total=total)
        stats.reused = total - sum(w.size * len(w.paths) for w in wants.values())
        digests: dict[str, str] = {}
        try:
            if wants:
                digests = await self._fill(
                    wants, source, stats, rate_limit, connections, progress, chunk
                )
        finally:
            self._release_reservation(reservation)
        manifest = manifest.with_digests(digests)
        digest = manifest.digest
        self._publish_snapshot(manifest, digest)
        self._commit_snapshot(ref, res.revision, manifest, digest, res)
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

    async def _fill(
        self,
        wants: dict[str, _Want],
        source: Any,
        stats: FillStats,
        rate_limit: float | None,
        connections: int,
        progress: Progress | None,
        chunk: int,
    ) -> dict[str, str]:
        """Fetch every wanted blob; returns manifest path -> sha256 for each."""
        executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="preheat-fill")
        ctx = FillContext(
            source=source,
            layout=self.layout,
            connections=Slots(connections),
            executor=executor,
            stats=stats,
            limiter=RateLimiter(rate_limit) if rate_limit else None,
            fsync=self.fsync,
            chunk=chunk,
            retries=self.retries,
            backoff=self.backoff,
        )
        files = asyncio.Semaphore(4)  # files hashed at once (one thread each)
        out: dict[str, str] = {}

        async def one(w: _Want, seq: int) -> None:
            async with files:
                lock = await lock_file(self.layout.tmp / f"{w.key}.lock")
                try:
                    digest = self._already_there(w)
                    if digest is not None:
                        stats.reused += w.size * len(w.paths)
                    else:
                        digest = await fetch_blob(
                            ctx, w.paths[0], w.location, w.size, w.expected, w.key, seq
                        )
                        self._record_blob(digest, w.size, w.location.fingerprint)
                finally:
                    unlock_file(lock)
            for p in w.paths:
                out[p] = digest

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
            if ctx.dirty_dirs:
                await asyncio.get_running_loop().run_in_executor(
                    executor, fsync_dirs, ctx.dirty_dirs
                )
        except BaseExceptionGroup as eg:
            first: BaseException = eg
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        finally:
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
            executor.shutdown(wait=False)
        return out

    def _already_there(self, w: _Want) -> str | None:
        """The digest if another puller published this blob while we waited for its lock."""
        if w.expected is not None:
            return w.expected if self.layout.blob(w.expected).exists() else None
        with self._db.connect() as con:
            row = con.execute(
                "SELECT digest FROM fingerprints WHERE fingerprint=?", (w.location.fingerprint,)
            ).fetchone()
        if row and self.layout.blob(row[0]).exists():
            return str(row[0])
        return None

    def _known_fingerprints(self, res: Resolution) -> dict[str, str]:
        """path -> sha256 for files without a digest whose fingerprint was hashed before."""
        unknown = {
            f.path: res.locations[f.path].fingerprint
            for f in res.manifest.files
            if f.sha256 is None
        }
        if not unknown:
            return {}
        out = {}
        with self._db.connect() as con:
            for path, fp in unknown.items():
                row = con.execute(
                    "SELECT digest FROM fingerprints WHERE fingerprint=?", (fp,)
                ).fetchone()
                if row and self.layout.blob(row[0]).exists():
                    out[path] = str(row[0])
        return out

    def _record_blob(self, digest: str, size: int, fingerprint: str) -> None:
        with self._db.write() as con:
            con.execute(
                "INSERT OR IGNORE INTO blobs(digest, size, added) VALUES (?,?,?)",
                (digest, size, time.time()),
            )
            con.execute(
                "INSERT OR REPLACE INTO fingerprints(fingerprint, digest) VALUES (?,?)",
                (fingerprint, digest),
            )

    def _publish_snapshot(self, manifest: Manifest, digest: str) -> None:
        final = self.layout.snapshot(digest)
        if final.is_dir():
            return
        work = self.layout.tmp / f"snap-{digest[:16]}-{uuid.uuid4().hex[:8]}"
        work.mkdir()
        try:
            for f in manifest.files:
                assert f.sha256 is not None
                dest = self.layout.inside(work, f.path)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(self.layout.blob(f.sha256), dest)
            try:
                os.rename(work, final)
            except OSError:
                if not final.is_dir():
                    raise
            if self.fsync:
                fsync_dirs({self.layout.snapshots, final})
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)

    def _commit_snapshot(
        self, ref: ArtifactRef, revision: str, manifest: Manifest, digest: str, res: Resolution
    ) -> None:
        now = time.time()
        with self._db.write() as con:
            con.execute(
                "INSERT INTO snapshots(digest, size, files, created, last_use, manifest) "
                "VALUES (?,?,?,?,?,?) ON CONFLICT(digest) DO UPDATE SET last_use=excluded.last_use",
                (digest, manifest.total_size, len(manifest.files), now, now, manifest.to_json()),
            )
            for f in manifest.files:
                assert f.sha256 is not None
                con.execute(
                    "INSERT OR IGNORE INTO snapshot_blobs(snapshot, blob) VALUES (?,?)",
                    (digest, f.sha256),
                )
                con.execute(
                    "INSERT OR IGNORE INTO blobs(digest, size, added) VALUES (?,?,?)",
                    (f.sha256, f.size, now),
                )
                fp = res.locations[f.path].fingerprint
                con.execute(
                    "INSERT OR IGNORE INTO fingerprints(fingerprint, digest) VALUES (?,?)",
                    (fp, f.sha256),
                )
            con.execute(
                "INSERT OR REPLACE INTO revisions(revision, digest, ref, resolved) VALUES (?,?,?,?)",
                (revision, digest, ref.text, now),
            )
        self._record_ref(ref, revision, digest)

    def _record_ref(self, ref: ArtifactRef, revision: str, digest: str) -> None:
        d = self.layout.refs / ref.key
        d.mkdir(parents=True, exist_ok=True)
        entry = {
            "ref": ref.text,
            "revision": revision,
            "manifest_digest": digest,
            "resolved": time.time(),
        }
        line = json.dumps(entry)
        tmp = d / f".latest.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        tmp.write_text(line + "\n")
        os.replace(tmp, d / "latest")
        with open(d / "history.jsonl", "a") as f:
            f.write(line + "\n")

    def _digest_for_revision(self, revision: str) -> str | None:
        with self._db.connect() as con:
            row = con.execute(
                "SELECT r.digest FROM revisions r JOIN snapshots s ON s.digest = r.digest "
                "WHERE r.revision=?",
                (revision,),
            ).fetchone()
        if row is None or not self.layout.snapshot(row[0]).is_dir():
            return None
        return str(row[0])

    def _touch(self, digest: str) -> None:
        with self._db.write() as con:
            con.execute("UPDATE snapshots SET last_use=? WHERE digest=?", (time.time(), digest))

    # --- space --------------------------------------------------------------------------

    def _usage(self, con: sqlite3.Connection) -> Usage:
        used = int(con.execute("SELECT coalesce(sum(size),0) FROM blobs").fetchone()[0])
        reserved = int(con.execute("SELECT coalesce(sum(bytes),0) FROM reservations").fetchone()[0])
        st = os.statvfs(self.root)
        disk_free = st.f_bavail * st.f_frsize
        free = disk_free - reserved
        if self.capacity is not None:
            free = min(free, int(self.capacity * self.high_watermark) - used - reserved)
        return Usage(self.capacity, self.high_watermark, used, reserved, disk_free, max(0, free))

    def usage(self) -> Usage:
        with self._db.connect() as con:
            return self._usage(con)

    def free_bytes(self) -> int:
        """Bytes a new fill may use now without evicting anything."""
        return self.usage().free

    def _reserve(self, ref: str, need: int, present: Iterable[str]) -> str | None:
        """Reserve ``need`` bytes, evicting by plan if needed; refuse with the numbers if even
        evicting everything evictable would not make room. Blobs in ``present`` are
        protected from that eviction (this pull links them)."""
        rid = uuid.uuid4().hex
        keep = set(present)
        with self._db.write() as con:
            for row in con.execute("SELECT id, pid FROM reservations").fetchall():
                if not _pid_alive(int(row[1])):
                    con.execute("DELETE FROM reservations WHERE id=?", (row[0],))
                    con.execute("DELETE FROM reservation_blobs WHERE reservation=?", (row[0],))
            u = self._usage(con)
            if need > u.free:
                protected = keep | self._protected_blobs(con)
                plan = plan_eviction(
                    self._infos(con), self._blob_sizes(con), need - u.free, protected
                )
                if not plan.enough:
                    cap = (
                        f"capacity {format_size(u.capacity)} x high watermark {u.high_watermark:.0%}"
                        if u.capacity
                        else "no capacity set"
                    )
                    err = InsufficientSpace(
                        f"cannot pull {ref}: it needs {format_size(need)} ({need} bytes) but only "
                        f"{format_size(u.free)} is free ({cap}; {format_size(u.used)} used, "
                        f"{format_size(u.reserved)} reserved by fills in flight, "
                        f"{format_size(u.disk_free)} free on disk), and evicting every "
                        f"unpinned, unleased snapshot frees only {format_size(plan.frees)}. "
                        "Raise --capacity, unpin or release snapshots, or free disk space."
                    )
                    err.need, err.free, err.evictable = need, u.free, plan.frees
                    raise err
                self._execute(con, plan)
            if need or keep:
                con.execute(
                    "INSERT INTO reservations(id, bytes, pid, created) VALUES (?,?,?,?)",
                    (rid, need, os.getpid(), time.time()),
                )
                con.executemany(
                    "INSERT INTO reservation_blobs(reservation, blob) VALUES (?,?)",
                    [(rid, b) for b in keep],
                )
                return rid
        return None

    def _release_reservation(self, rid: str | None) -> None:
        if rid is None:
            return
        with self._db.write() as con:
            con.execute("DELETE FROM reservations WHERE id=?", (rid,))
            con.execute("DELETE FROM reservation_blobs WHERE reservation=?", (rid,))

    def _protected_blobs(self, con: sqlite3.Connection) -> set[str]:
        return {str(r[0]) for r in con.execute("SELECT blob FROM reservation_blobs")}

    def _blob_sizes(self, con: sqlite3.Connection) -> dict[str, int]:
        return {str(d): int(s) for d, s in con.execute("SELECT digest, size FROM blobs")}

    def _infos(self, con: sqlite3.Connection) -> list[SnapshotInfo]:
        leases: dict[str, list[str]] = {}
        for d, h in con.execute("SELECT digest, holder FROM leases ORDER BY since"):
            leases.setdefault(d, []).append(h)
        blobs: dict[str, set[str]] = {}
        for s, b in con.execute("SELECT snapshot, blob FROM snapshot_blobs"):
            blobs.setdefault(s, set()).add(b)
        revs: dict[str, list[str]] = {}
        refs: dict[str, list[str]] = {}
        for rev, d, ref in con.execute(
            "SELECT revision, digest, ref FROM revisions ORDER BY resolved"
        ):
            revs.setdefault(d, []).append(rev)
            if ref not in refs.setdefault(d, []):
                refs[d].append(ref)
        out = []
        for d, size, files, created, last_use, pinned, priority in con.execute(
            "SELECT digest, size, files, created, last_use, pinned, priority FROM snapshots"
        ):
            out.append(
                SnapshotInfo(
                    digest=d,
                    size=int(size),
                    files=int(files),
                    created=float(created),
                    last_use=float(last_use),
                    pinned=bool(pinned),
                    leases=tuple(leases.get(d, ())),
                    priority=int(priority),
                    blobs=frozenset(blobs.get(d, ())),
                    revisions=tuple(revs.get(d, ())),
                    refs=tuple(refs.get(d, ())),
                )
            )
        return out

    # --- eviction -----------------------------------------------------------------------

    def plan_eviction(self, free_bytes: int) -> EvictionPlan:
        """A plan that frees ``free_bytes`` (priority, then least recent use; never pinned
        or leased snapshots, never blobs a fill in flight needs)."""
        with self._db.connect() as con:
            return plan_eviction(
                self._infos(con), self._blob_sizes(con), free_bytes, self._protected_blobs(con)
            )

    def execute(self, plan: EvictionPlan) -> EvictionPlan:
        """Carry out ``plan``; returns what was actually removed (pins and leases are
        re-checked, so a snapshot leased since planning is skipped)."""
        with self._db.write() as con:
            return self._execute(con, plan)

    def _execute(self, con: sqlite3.Connection, plan: EvictionPlan) -> EvictionPlan:
        done_snaps: list[str] = []
        for d in plan.snapshots:
            row = con.execute("SELECT pinned FROM snapshots WHERE digest=?", (d,)).fetchone()
            leased = con.execute("SELECT 1 FROM leases WHERE digest=? LIMIT 1", (d,)).fetchone()
            if row is None or row[0] or leased:
                continue
            self._drop_snapshot(con, d)
            done_snaps.append(d)
        protected = self._protected_blobs(con)
        done_blobs: list[str] = []
        frees = 0
        for b in plan.blobs:
            if b in protected:
                continue
            if con.execute("SELECT 1 FROM snapshot_blobs WHERE blob=? LIMIT 1", (b,)).fetchone():
                continue
            size = con.execute("SELECT size FROM blobs WHERE digest=?", (b,)).fetchone()
            self._drop_blob(con, b)
            done_blobs.append(b)
            frees += int(size[0]) if size else 0
        return EvictionPlan(plan.need, tuple(done_snaps), tuple(done_blobs), frees)

    def _drop_snapshot(self, con: sqlite3.Connection, digest: str) -> None:
        """Pointers first: the DB rows, then the snapshot directory (renamed away first so
        it vanishes atomically)."""
        con.execute("DELETE FROM snapshots WHERE digest=?", (digest,))
        con.execute("DELETE FROM snapshot_blobs WHERE snapshot=?", (digest,))
        con.execute("DELETE FROM revisions WHERE digest=?", (digest,))
        con.execute("DELETE FROM leases WHERE digest=?", (digest,))
        path = self.layout.snapshot(digest)
        if path.exists():
            trash = self.layout.tmp / f"trash-{digest[:16]}-{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def _drop_blob(self, con: sqlite3.Connection, digest: str) -> None:
        con.execute("DELETE FROM blobs WHERE digest=?", (digest,))
        con.execute("DELETE FROM fingerprints WHERE digest=?", (digest,))
        with contextlib.suppress(FileNotFoundError):
            self.layout.blob(digest).unlink()

    def delete(self, manifest_digest: str) -> EvictionPlan:
        """Remove one snapshot and the blobs only it used; refuses a leased snapshot."""
        with self._db.write() as con:
            self._require(con, manifest_digest)
            holders = [
                h
                for (h,) in con.execute(
                    "SELECT holder FROM leases WHERE digest=?", (manifest_digest,)
                )
            ]
            if holders:
                raise SnapshotInUse(
                    f"snapshot {manifest_digest[:16]} is leased by {', '.join(holders)}; "
                    "release the leases first"
                )
            blobs = [
                b
                for (b,) in con.execute(
                    "SELECT blob FROM snapshot_blobs WHERE snapshot=?", (manifest_digest,)
                )
            ]
            con.execute("UPDATE snapshots SET pinned=0 WHERE digest=?", (manifest_digest,))
            plan = EvictionPlan(0, (manifest_digest,), tuple(sorted(set(blobs))), 0)
            return self._execute(con, plan)

    # --- metadata -----------------------------------------------------------------------

    def _require(self, con: sqlite3.Connection, key: str) -> str:
        """The snapshot digest for a manifest digest or revision, or SnapshotNotFound."""
        row = con.execute("SELECT digest FROM snapshots WHERE digest=?", (key,)).fetchone()
        if row is None:
            row = con.execute(
                "SELECT r.digest FROM revisions r JOIN snapshots s ON s.digest=r.digest "
                "WHERE r.revision=?",
                (key,),
            ).fetchone()
        if row is None:
            rows = (
                con.execute(
                    "SELECT digest FROM snapshots WHERE digest LIKE ?", (key + "%",)
                ).fetchall()
                if len(key) >= 8
                else []
            )
            if len(rows) == 1:
                row = rows[0]
        if row is None:
            raise SnapshotNotFound(
                f"no snapshot {key!r} in {self.root}; list them with `preheat cache ls --store {self.root}`"
            )
        return str(row[0])

    def resolve(self, ref: str, *, endpoint_url: str | None = None) -> tuple[str, Manifest]:
        """What ``ref`` names now: (revision, manifest). Digests unknown at the origin are
        filled in from the store when this revision was pulled before."""

        async def go() -> tuple[str, Manifest]:
            src = open_source(ref, endpoint_url=endpoint_url)
            try:
                res = await src.resolve()
            finally:
                await src.aclose()
            known = self._digest_for_revision(res.revision)
            if known is not None:
                with self._db.connect() as con:
                    row = con.execute(
                        "SELECT manifest FROM snapshots WHERE digest=?", (known,)
                    ).fetchone()
                return res.revision, Manifest.from_json(row[0])
            return res.revision, res.manifest.with_digests(self._known_fingerprints(res))

        return asyncio.run(go())

    def has(self, key: str) -> bool:
        """True when a complete snapshot for this manifest digest or revision is present."""
        with self._db.connect() as con:
            try:
                digest = self._require(con, key)
            except SnapshotNotFound:
                return False
        return self.layout.snapshot(digest).is_dir()

    def snapshot_path(self, key: str) -> Path:
        with self._db.connect() as con:
            return self.layout.snapshot(self._require(con, key))

    def manifest(self, key: str) -> Manifest:
        with self._db.connect() as con:
            d = self._require(con, key)
            row = con.execute("SELECT manifest FROM snapshots WHERE digest=?", (d,)).fetchone()
        return Manifest.from_json(row[0])

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot, most recently used first."""
        with self._db.connect() as con:
            return sorted(self._infos(con), key=lambda s: -s.last_use)

    def eviction_candidates(self) -> list[SnapshotInfo]:
        """Evictable snapshots in the order eviction would take them."""
        return eviction_order(self.snapshots())

    def lease(self, manifest_digest: str, holder: str) -> None:
        """Mark a snapshot as in use by ``holder`` (survives restarts; never evicted)."""
        if not holder:
            raise ConfigError("lease holder must be a non-empty name, e.g. 'replica-3'")
        now = time.time()
        with self._db.write() as con:
            d = self._require(con, manifest_digest)
            con.execute(
                "INSERT OR IGNORE INTO leases(digest, holder, since) VALUES (?,?,?)",
                (d, holder, now),
            )
            con.execute("UPDATE snapshots SET last_use=? WHERE digest=?", (now, d))

    def release(self, manifest_digest: str, holder: str) -> bool:
        """Drop ``holder``'s lease; returns whether it held one."""
        with self._db.write() as con:
            cur = con.execute(
                "DELETE FROM leases WHERE (digest=? OR digest IN "
                "(SELECT digest FROM revisions WHERE revision=?)) AND holder=?",
                (manifest_digest, manifest_digest, holder),
            )
            con.execute(
                "UPDATE snapshots SET last_use=? WHERE digest=?", (time.time(), manifest_digest)
            )
            return cur.rowcount > 0

    def release_holder(self, holder: str) -> int:
        """Drop every lease ``holder`` has (a replica that is gone); returns how many."""
        with self._db.write() as con:
            return con.execute("DELETE FROM leases WHERE holder=?", (holder,)).rowcount

    def leases(self, manifest_digest: str) -> list[str]:
        with self._db.connect() as con:
            d = self._require(con, manifest_digest)
            return [
                h
                for (h,) in con.execute(
                    "SELECT holder FROM leases WHERE digest=? ORDER BY since", (d,)
                )
            ]

    def pin(self, manifest_digest: str) -> None:
        self._set(manifest_digest, "pinned", 1)

    def unpin(self, manifest_digest: str) -> None:
        self._set(manifest_digest, "pinned", 0)

    def set_priority(self, manifest_digest: str, priority: int) -> None:
        """Higher priority snapshots are evicted later (ties: least recently used first)."""
        self._set(manifest_digest, "priority", int(priority))

    def _set(self, key: str, column: str, value: int) -> None:
        with self._db.write() as con:
            d = self._require(con, key)
            con.execute(f"UPDATE snapshots SET {column}=? WHERE digest=?", (value, d))

    # --- housekeeping -------------------------------------------------------------------

    def clean_tmp(self, *, partial_max_age: float = 86400.0, work_max_age: float = 600.0) -> int:
        """Remove leftovers in ``tmp/``: snapshot work dirs and trash older than
        ``work_max_age`` s, and partial downloads nobody holds the lock of that were last
        touched more than ``partial_max_age`` s ago. Returns how many entries went."""
        now = time.time()
        removed = 0
        for p in self.layout.tmp.iterdir():
            try:
                age = now - p.lstat().st_mtime
            except FileNotFoundError:
                continue
            if p.is_dir() and p.name.startswith(("snap-", "trash-")) and age > work_max_age:
                shutil.rmtree(p, ignore_errors=True)
                removed += 1
            elif p.suffix == ".part" and age > partial_max_age:
                lock = p.with_suffix(".lock")
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # a fill is using it
                    for q in (p, p.with_suffix(".json")):
                        with contextlib.suppress(FileNotFoundError):
                            q.unlink()
                    removed += 1
                finally:
                    os.close(fd)
        return removed

    # --- verification -------------------------------------------------------------------

    def verify(self, *, quarantine: bool = True, workers: int = 2) -> VerifyReport:
        """Re-hash every blob. Corrupt blobs move to ``quarantine/``; snapshots that use them
        are removed (pointers first) so the next pull fetches them again."""
        t0 = time.monotonic()
        cleaned = self.clean_tmp() if quarantine else 0
        with self._db.connect() as con:
            blobs = self._blob_sizes(con)
            infos = self._infos(con)
        for p in self.layout.blobs.glob("??/*"):
            blobs.setdefault(p.name, p.stat().st_size)

        def check(digest: str) -> tuple[str, str | None]:
            path = self.layout.blob(digest)
            h = hashlib.sha256()
            try:
                with open(path, "rb", buffering=0) as f:
                    while chunk := f.read(16 << 20):
                        h.update(chunk)
            except FileNotFoundError:
                return digest, "missing"
            actual = h.hexdigest()
            return digest, None if actual == digest else actual

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            results = list(pool.map(check, sorted(blobs)))
        corrupt = tuple((d, a) for d, a in results if a is not None)
        bad = {d for d, _ in corrupt}
        affected = [s.digest for s in infos if s.blobs & bad]
        missing = tuple(s.digest for s in infos if not self.layout.snapshot(s.digest).is_dir())
        removed: list[str] = []
        if quarantine and (bad or missing):
            with self._db.write() as con:
                for d in sorted(set(affected) | set(missing)):
                    self._drop_snapshot(con, d)
                    removed.append(d)
                for d, actual in corrupt:
                    con.execute("DELETE FROM blobs WHERE digest=?", (d,))
                    con.execute("DELETE FROM fingerprints WHERE digest=?", (d,))
                    src = self.layout.blob(d)
                    if actual != "missing" and src.exists():
                        os.replace(src, self.layout.quarantine / f"{d}.{int(time.time())}")
        return VerifyReport(
            checked=len(blobs),
            bytes=sum(blobs.values()),
            corrupt=corrupt,
            removed_snapshots=tuple(removed),
            missing_snapshots=missing,
            seconds=time.monotonic() - t0,
            cleaned_tmp=cleaned,
        )
