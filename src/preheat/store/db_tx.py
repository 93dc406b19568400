"""The store's SQL statements: ``Tx``, the one repository of every statement the store runs.

Tables (``store.db_schema``): snapshots, snapshot_blobs, revisions, blobs, leases,
fingerprints, reservations, reservation_blobs, images (the image cache: which snapshot is
which image), revoked (the store's revocation list). ``Db.read()`` and ``Db.write()``
(``store.db``) hand out a ``Tx``; nothing else in preheat writes SQL against ``store.db``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Mapping

from preheat.artifacts.manifest import Manifest
from preheat.sources.base import Resolution
from preheat.store.evict import SnapshotInfo

__all__ = ["Tx"]


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
        self.shrink_reservation(rid, size)

    def shrink_reservation(self, rid: str, n: int) -> None:
        """Reservation ``rid`` counts ``n`` bytes fewer (never below zero)."""
        self.con.execute("UPDATE reservations SET bytes=max(0, bytes-?) WHERE id=?", (n, rid))

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
