"""The store's sqlite metadata: the one repository that owns every SQL statement.

Tables: snapshots, snapshot_blobs, revisions, blobs, leases, fingerprints, reservations,
reservation_blobs, images (the image cache: which snapshot is which image), revoked (the
store's revocation list). ``Db.read()`` and ``Db.write()`` hand out a ``Tx``, whose methods are
the only statements the store runs; nothing else in preheat writes SQL against
``store.db``.

Every call opens its own connection (WAL mode, 30 s busy timeout), so one ``NodeStore``
can be used from several threads and several processes can share one store. Writes that
must decide on a consistent view (reserving space, evicting) run in ``BEGIN IMMEDIATE``.
These calls block (up to the busy timeout): async callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from preheat.artifacts.manifest import Manifest
from preheat.errors import CacheError
from preheat.sources.base import Resolution
from preheat.store.evict import SnapshotInfo

# PRAGMA user_version of the schema below. 0: before identity keys (revisions keyed by the
# revision string alone; blobs without the stat recorded at publish); 2: identity keys;
# 3: now (adds the images and revoked tables; nothing else changes).
VERSION = 3

SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    files INTEGER NOT NULL,
    created REAL NOT NULL,
    last_use REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    priority INTEGER NOT NULL DEFAULT 0,
    manifest TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshot_blobs (
    snapshot TEXT NOT NULL,
    blob TEXT NOT NULL,
    PRIMARY KEY (snapshot, blob)
);
CREATE INDEX IF NOT EXISTS snapshot_blobs_blob ON snapshot_blobs(blob);
CREATE TABLE IF NOT EXISTS revisions (
    source TEXT NOT NULL,
    revision TEXT NOT NULL,
    digest TEXT NOT NULL,
    label TEXT,
    ref TEXT NOT NULL,
    endpoint TEXT,
    resolved REAL NOT NULL,
    PRIMARY KEY (source, revision)
);
CREATE INDEX IF NOT EXISTS revisions_revision ON revisions(revision);
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    added REAL NOT NULL,
    mtime_ns INTEGER,
    ctime_ns INTEGER
);
CREATE TABLE IF NOT EXISTS leases (
    digest TEXT NOT NULL,
    holder TEXT NOT NULL,
    since REAL NOT NULL,
    PRIMARY KEY (digest, holder)
);
CREATE TABLE IF NOT EXISTS fingerprints (
    fingerprint TEXT PRIMARY KEY,
    digest TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS reservation_blobs (
    reservation TEXT NOT NULL,
    blob TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS images (
    digest TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    tag TEXT,
    top_digest TEXT NOT NULL,
    platform TEXT NOT NULL,
    snapshot TEXT NOT NULL,
    config TEXT NOT NULL,
    layers INTEGER NOT NULL,
    size INTEGER NOT NULL,
    pulled REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS images_top ON images(top_digest);
CREATE TABLE IF NOT EXISTS revoked (
    key TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    since REAL NOT NULL
);
"""


class Tx:
    """The statements of the store, on one connection (inside a transaction for writes)."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self.con = con

    # --- revisions and refs ---------------------------------------------------------------

    def lookup(self, source: str, revision: str) -> tuple[str, str] | None:
        """(digest, manifest JSON) of the snapshot that (source, revision) resolved to."""
        row = self.con.execute(
            "SELECT r.digest, s.manifest FROM revisions r JOIN snapshots s ON s.digest=r.digest "
            "WHERE r.source=? AND r.revision=?",
            (source, revision),
        ).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    def record_revision(
        self, source: str, res: Resolution, digest: str, *, endpoint: str | None
    ) -> None:
        """Remember that (source, ``res.revision``) names snapshot ``digest``."""
        self.con.execute(
            "INSERT OR REPLACE INTO revisions(source, revision, digest, label, ref, endpoint, "
            "resolved) VALUES (?,?,?,?,?,?,?)",
            (source, res.revision, digest, res.label, res.ref.text, endpoint, time.time()),
        )

    def origins(self, digest: str) -> list[tuple[str, str | None]]:
        """(ref, endpoint) of every resolution to this snapshot, most recent first."""
        return [
            (str(r), None if e is None else str(e))
            for r, e in self.con.execute(
                "SELECT ref, endpoint FROM revisions WHERE digest=? ORDER BY resolved DESC",
                (digest,),
            )
        ]

    def require(self, key: str) -> str | None:
        """The snapshot digest for a manifest digest, revision or unique digest prefix."""
        row = self.con.execute("SELECT digest FROM snapshots WHERE digest=?", (key,)).fetchone()
        if row is None:
            row = self.con.execute(
                "SELECT r.digest FROM revisions r JOIN snapshots s ON s.digest=r.digest "
                "WHERE r.revision=? ORDER BY r.resolved DESC LIMIT 1",
                (key,),
            ).fetchone()
        if row is None and len(key) >= 8:
            rows = self.con.execute(
                "SELECT digest FROM snapshots WHERE digest LIKE ?", (key + "%",)
            ).fetchall()
            if len(rows) == 1:
                row = rows[0]
        return None if row is None else str(row[0])

    # --- blobs and fingerprints -----------------------------------------------------------

    def fingerprint_digest(self, fingerprint: str) -> str | None:
        row = self.con.execute(
            "SELECT digest FROM fingerprints WHERE fingerprint=?", (fingerprint,)
        ).fetchone()
        return None if row is None else str(row[0])

    def record_blob(self, digest: str, size: int, fingerprint: str) -> None:
        self.con.execute(
            "INSERT OR IGNORE INTO blobs(digest, size, added) VALUES (?,?,?)",
            (digest, size, time.time()),
        )
        self.con.execute(
            "INSERT OR REPLACE INTO fingerprints(fingerprint, digest) VALUES (?,?)",
            (fingerprint, digest),
        )

    def blob_sizes(self) -> dict[str, int]:
        return {str(d): int(s) for d, s in self.con.execute("SELECT digest, size FROM blobs")}

    def blob_size(self, digest: str) -> int | None:
        row = self.con.execute("SELECT size FROM blobs WHERE digest=?", (digest,)).fetchone()
        return None if row is None else int(row[0])

    def blob_in_use(self, digest: str) -> bool:
        return (
            self.con.execute(
                "SELECT 1 FROM snapshot_blobs WHERE blob=? LIMIT 1", (digest,)
            ).fetchone()
            is not None
        )

    def snapshots_with_blob(self, digest: str) -> list[str]:
        return [
            str(s)
            for (s,) in self.con.execute(
                "SELECT snapshot FROM snapshot_blobs WHERE blob=? ORDER BY snapshot", (digest,)
            )
        ]

    def blob_stat(self, digest: str) -> tuple[int, int, int] | None:
        """(size, mtime_ns, ctime_ns) recorded when the store last linked the blob."""
        row = self.con.execute(
            "SELECT size, mtime_ns, ctime_ns FROM blobs WHERE digest=?", (digest,)
        ).fetchone()
        if row is None or row[1] is None or row[2] is None:
            return None
        return int(row[0]), int(row[1]), int(row[2])

    def set_blob_stat(self, digest: str, size: int, mtime_ns: int, ctime_ns: int) -> None:
        self.con.execute(
            "INSERT INTO blobs(digest, size, added, mtime_ns, ctime_ns) VALUES (?,?,?,?,?) "
            "ON CONFLICT(digest) DO UPDATE SET mtime_ns=excluded.mtime_ns, "
            "ctime_ns=excluded.ctime_ns",
            (digest, size, time.time(), mtime_ns, ctime_ns),
        )

    def drop_revisions(self, digest: str) -> None:
        """Forget every resolution to this snapshot (the next pull of its refs misses)."""
        self.con.execute("DELETE FROM revisions WHERE digest=?", (digest,))

    def drop_blob(self, digest: str) -> None:
        self.con.execute("DELETE FROM blobs WHERE digest=?", (digest,))
        self.con.execute("DELETE FROM fingerprints WHERE digest=?", (digest,))

    # --- snapshots ------------------------------------------------------------------------

    def commit_snapshot(
        self, manifest: Manifest, digest: str, fingerprints: Mapping[str, str]
    ) -> None:
        now = time.time()
        self.con.execute(
            "INSERT INTO snapshots(digest, size, files, created, last_use, manifest) "
            "VALUES (?,?,?,?,?,?) ON CONFLICT(digest) DO UPDATE SET last_use=excluded.last_use",
            (digest, manifest.total_size, len(manifest.files), now, now, manifest.to_json()),
        )
        for f in manifest.files:
            assert f.sha256 is not None
            self.con.execute(
                "INSERT OR IGNORE INTO snapshot_blobs(snapshot, blob) VALUES (?,?)",
                (digest, f.sha256),
            )
            self.con.execute(
                "INSERT OR IGNORE INTO blobs(digest, size, added) VALUES (?,?,?)",
                (f.sha256, f.size, now),
            )
            self.con.execute(
                "INSERT OR IGNORE INTO fingerprints(fingerprint, digest) VALUES (?,?)",
                (fingerprints[f.path], f.sha256),
            )

    def touch(self, digest: str) -> None:
        self.con.execute("UPDATE snapshots SET last_use=? WHERE digest=?", (time.time(), digest))

    def manifest_json(self, digest: str) -> str | None:
        row = self.con.execute(
            "SELECT manifest FROM snapshots WHERE digest=?", (digest,)
        ).fetchone()
        return None if row is None else str(row[0])

    def pinned(self, digest: str) -> bool | None:
        """Whether the snapshot is pinned; None when it does not exist."""
        row = self.con.execute("SELECT pinned FROM snapshots WHERE digest=?", (digest,)).fetchone()
        return None if row is None else bool(row[0])

    def set_flag(self, digest: str, column: str, value: int) -> None:
        if column not in ("pinned", "priority"):
            raise ValueError(f"column {column!r} is not settable")
        self.con.execute(f"UPDATE snapshots SET {column}=? WHERE digest=?", (value, digest))

    def snapshot_blobs(self, digest: str) -> list[str]:
        return [
            str(b)
            for (b,) in self.con.execute(
                "SELECT blob FROM snapshot_blobs WHERE snapshot=?", (digest,)
            )
        ]

    def drop_snapshot(self, digest: str) -> None:
        self.con.execute("DELETE FROM snapshots WHERE digest=?", (digest,))
        self.con.execute("DELETE FROM snapshot_blobs WHERE snapshot=?", (digest,))
        self.con.execute("DELETE FROM revisions WHERE digest=?", (digest,))
        self.con.execute("DELETE FROM leases WHERE digest=?", (digest,))

    def infos(self) -> list[SnapshotInfo]:
        leases: dict[str, list[str]] = {}
        for d, h in self.con.execute("SELECT digest, holder FROM leases ORDER BY since"):
            leases.setdefault(d, []).append(h)
        blobs: dict[str, set[str]] = {}
        for s, b in self.con.execute("SELECT snapshot, blob FROM snapshot_blobs"):
            blobs.setdefault(s, set()).add(b)
        revs: dict[str, list[str]] = {}
        refs: dict[str, list[str]] = {}
        labels: dict[str, list[str]] = {}
        for rev, d, ref, label in self.con.execute(
            "SELECT revision, digest, ref, label FROM revisions ORDER BY resolved"
        ):
            if rev not in revs.setdefault(d, []):
                revs[d].append(rev)
            if ref not in refs.setdefault(d, []):
                refs[d].append(ref)
            if label and label not in labels.setdefault(d, []):
                labels[d].append(label)
        out = []
        for d, size, files, created, last_use, pinned, priority in self.con.execute(
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
                    labels=tuple(labels.get(d, ())),
                )
            )
        return out

    # --- leases ---------------------------------------------------------------------------

    def holders(self, digest: str) -> list[str]:
        return [
            str(h)
            for (h,) in self.con.execute(
                "SELECT holder FROM leases WHERE digest=? ORDER BY since", (digest,)
            )
        ]

    def leased(self, digest: str) -> bool:
        return (
            self.con.execute("SELECT 1 FROM leases WHERE digest=? LIMIT 1", (digest,)).fetchone()
            is not None
        )

    def add_lease(self, digest: str, holder: str, now: float) -> None:
        self.con.execute(
            "INSERT OR IGNORE INTO leases(digest, holder, since) VALUES (?,?,?)",
            (digest, holder, now),
        )
        self.con.execute("UPDATE snapshots SET last_use=? WHERE digest=?", (now, digest))

    def drop_lease(self, key: str, holder: str) -> bool:
        """Drop ``holder``'s lease on the snapshot named by digest or revision ``key``."""
        cur = self.con.execute(
            "DELETE FROM leases WHERE (digest=? OR digest IN "
            "(SELECT digest FROM revisions WHERE revision=?)) AND holder=?",
            (key, key, holder),
        )
        self.con.execute("UPDATE snapshots SET last_use=? WHERE digest=?", (time.time(), key))
        return cur.rowcount > 0

    def drop_holder(self, holder: str) -> int:
        return int(self.con.execute("DELETE FROM leases WHERE holder=?", (holder,)).rowcount)

    # --- space ----------------------------------------------------------------------------

    def used_bytes(self) -> int:
        return int(self.con.execute("SELECT coalesce(sum(size),0) FROM blobs").fetchone()[0])

    def reserved_bytes(self) -> int:
        return int(
            self.con.execute("SELECT coalesce(sum(bytes),0) FROM reservations").fetchone()[0]
        )

    def reservations(self) -> list[tuple[str, int]]:
        """(id, owner pid) of every reservation."""
        return [(str(r), int(p)) for r, p in self.con.execute("SELECT id, pid FROM reservations")]

    def add_reservation(self, rid: str, need: int, pid: int, blobs: Iterable[str]) -> None:
        self.con.execute(
            "INSERT INTO reservations(id, bytes, pid, created) VALUES (?,?,?,?)",
            (rid, need, pid, time.time()),
        )
        self.con.executemany(
            "INSERT INTO reservation_blobs(reservation, blob) VALUES (?,?)",
            [(rid, b) for b in blobs],
        )

    def protect_blob(self, rid: str, digest: str, size: int) -> None:
        """``digest`` is now on disk for reservation ``rid``: protect it and stop counting
        its bytes as reserved (they are counted as used)."""
        self.con.execute(
            "INSERT INTO reservation_blobs(reservation, blob) VALUES (?,?)", (rid, digest)
        )
        self.con.execute("UPDATE reservations SET bytes=max(0, bytes-?) WHERE id=?", (size, rid))

    def drop_reservation(self, rid: str) -> None:
        self.con.execute("DELETE FROM reservations WHERE id=?", (rid,))
        self.con.execute("DELETE FROM reservation_blobs WHERE reservation=?", (rid,))

    def protected_blobs(self) -> set[str]:
        return {str(r[0]) for r in self.con.execute("SELECT blob FROM reservation_blobs")}

    # --- images (preheat.images.cache) ----------------------------------------------------

    _IMAGE_COLS = "digest, name, tag, top_digest, platform, snapshot, config, layers, size, pulled"

    def record_image(self, row: tuple[object, ...]) -> None:
        """One image: (digest, name, tag, top_digest, platform, snapshot, config, layers,
        size, pulled); a new pull of the same digest updates it."""
        self.con.execute(
            f"INSERT OR REPLACE INTO images({self._IMAGE_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
            row,
        )

    def images(self) -> list[tuple[object, ...]]:
        """Every image whose snapshot is still in the store, most recently pulled first."""
        return [
            tuple(r)
            for r in self.con.execute(
                f"SELECT {self._IMAGE_COLS} FROM images WHERE snapshot IN "
                "(SELECT digest FROM snapshots) ORDER BY pulled DESC"
            )
        ]

    def drop_image(self, digest: str) -> None:
        self.con.execute("DELETE FROM images WHERE digest=?", (digest,))

    def drop_orphan_images(self) -> int:
        """Forget images whose snapshot left the store (evicted, revoked, deleted)."""
        return int(
            self.con.execute(
                "DELETE FROM images WHERE snapshot NOT IN (SELECT digest FROM snapshots)"
            ).rowcount
        )

    # --- revocation (preheat.store.revoke) ------------------------------------------------

    def revoke(self, key: str, reason: str) -> None:
        self.con.execute(
            # Revoking again updates the reason and keeps when it was first revoked.
            "INSERT INTO revoked(key, reason, since) VALUES (?,?,?) "
            "ON CONFLICT(key) DO UPDATE SET reason=excluded.reason",
            (key, reason, time.time()),
        )

    def unrevoke(self, key: str) -> bool:
        return self.con.execute("DELETE FROM revoked WHERE key=?", (key,)).rowcount > 0

    def revoked(self) -> dict[str, tuple[str, float]]:
        """key -> (reason, since) of every revocation."""
        return {
            str(k): (str(r), float(t))
            for k, r, t in self.con.execute("SELECT key, reason, since FROM revoked")
        }


def _migrate_from_0(con: sqlite3.Connection, tables: set[str]) -> None:
    """Version 0 keyed revisions by the revision string alone: re-key each row by its
    ref's source identity (an S3 row's endpoint was not recorded: the default one), and
    give blobs the stat columns (unknown: the next lease re-hashes them once)."""
    if "revisions" in tables:
        from preheat.artifacts.refs import parse_ref
        from preheat.sources.base import source_identity

        rows = con.execute("SELECT revision, digest, ref, resolved FROM revisions").fetchall()
        con.execute("DROP TABLE revisions")
        _create(con)
        for revision, digest, ref, resolved in rows:
            try:
                source = source_identity(parse_ref(ref))
            except ValueError:
                source = str(ref)
            con.execute(
                "INSERT OR REPLACE INTO revisions(source, revision, digest, label, ref, "
                "endpoint, resolved) VALUES (?,?,?,NULL,?,NULL,?)",
                (source, revision, digest, ref, resolved),
            )
    if "blobs" in tables:
        cols = {r[1] for r in con.execute("PRAGMA table_info(blobs)")}
        for col in ("mtime_ns", "ctime_ns"):
            if col not in cols:
                con.execute(f"ALTER TABLE blobs ADD COLUMN {col} INTEGER")


def _create(con: sqlite3.Connection) -> None:
    for stmt in SCHEMA.split(";"):
        if stmt.strip():
            con.execute(stmt)


class Db:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Switching to WAL needs a moment alone with the file; two processes opening a new
        # store at once may see SQLITE_BUSY here even with a busy timeout, so retry.
        for attempt in range(50):
            try:
                with self.connect() as con:
                    if con.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        con.execute("PRAGMA journal_mode=WAL")
                    self._upgrade(con)
                return
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or attempt == 49:
                    raise
                time.sleep(0.02 * (attempt + 1))

    def _upgrade(self, con: sqlite3.Connection) -> None:
        """Create the schema, or migrate an older one in place (one transaction)."""
        if con.execute("PRAGMA user_version").fetchone()[0] == VERSION:
            return
        con.execute("BEGIN IMMEDIATE")
        try:
            version = int(con.execute("PRAGMA user_version").fetchone()[0])
            if version > VERSION:
                raise CacheError(
                    f"{self.path} has schema version {version}, newer than this preheat "
                    f"understands ({VERSION}); upgrade preheat, or use another --store"
                )
            tables = {
                str(r[0]) for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            if version < 2 and tables:
                _migrate_from_0(con, tables)
            # 2 -> 3 only adds tables: _create below makes them
            _create(con)
            con.execute(f"PRAGMA user_version={VERSION}")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")

    @contextlib.contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """An autocommit connection, closed on exit."""
        con = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("PRAGMA foreign_keys=OFF")
            yield con
        finally:
            con.close()

    @contextlib.contextmanager
    def read(self) -> Iterator[Tx]:
        """Statements on an autocommit connection (each one sees the latest commit)."""
        with self.connect() as con:
            yield Tx(con)

    @contextlib.contextmanager
    def write(self) -> Iterator[Tx]:
        """A ``BEGIN IMMEDIATE`` transaction: one writer at a time across processes."""
        with self.connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield Tx(con)
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
