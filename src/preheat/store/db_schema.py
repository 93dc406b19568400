"""The store's sqlite schema: its tables, its version, and the migration of older ones.

``store.db.Db`` creates the schema on a new store and upgrades an older one in place
(``PRAGMA user_version``) in one transaction.
"""

from __future__ import annotations

import sqlite3

__all__ = ["SCHEMA", "VERSION", "create", "migrate_from_0"]

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


def migrate_from_0(con: sqlite3.Connection, tables: set[str]) -> None:
    """Version 0 keyed revisions by the revision string alone: re-key each row by its
    ref's source identity (an S3 row's endpoint was not recorded: the default one), and
    give blobs the stat columns (unknown: the next lease re-hashes them once)."""
    if "revisions" in tables:
        from preheat.artifacts.refs import parse_ref
        from preheat.sources.base import source_identity

        rows = con.execute("SELECT revision, digest, ref, resolved FROM revisions").fetchall()
        con.execute("DROP TABLE revisions")
        create(con)
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


def create(con: sqlite3.Connection) -> None:
    for stmt in SCHEMA.split(";"):
        if stmt.strip():
            con.execute(stmt)
