"""The store's sqlite metadata: snapshots, revisions, blobs, leases, fingerprints, reservations.

Every call opens its own connection (WAL mode, 30 s busy timeout), so one ``NodeStore``
can be used from several threads and several processes can share one store. Writes that
must decide on a consistent view (reserving space, evicting) run in ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

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
    revision TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    ref TEXT NOT NULL,
    resolved REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    added REAL NOT NULL
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
"""


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
                    con.executescript(SCHEMA)
                return
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or attempt == 49:
                    raise
                time.sleep(0.02 * (attempt + 1))

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
    def write(self) -> Iterator[sqlite3.Connection]:
        """A ``BEGIN IMMEDIATE`` transaction: one writer at a time across processes."""
        with self.connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
