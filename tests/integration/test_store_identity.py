"""A cache hit is decided by content, never by a declared name (real nginx, real files)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from preheat.bench.models import generate_model, rewrite_shard, write_http_manifest
from preheat.errors import CacheError, RevisionChanged
from preheat.store import NodeStore
from preheat.testing.origins import nginx_origin

MiB = 1 << 20


def _tree(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != "preheat-manifest.json"
    }


def test_two_models_declaring_main_get_their_own_weights(tmp_path: Path) -> None:
    """Two different models whose manifests both say "revision": "main" are two snapshots."""
    root = tmp_path / "origin"
    generate_model(root / "a", 4 * MiB, 2, seed=1)
    generate_model(root / "b", 4 * MiB, 2, seed=2)
    write_http_manifest(root / "a", revision="main")
    write_http_manifest(root / "b", revision="main")
    store = NodeStore(tmp_path / "store", fsync=False)
    with nginx_origin(root) as o:
        a = store.pull(o.url("a/preheat-manifest.json"))
        b = store.pull(o.url("b/preheat-manifest.json"))
    assert b.bytes_fetched == 4 * MiB + (root / "b" / "config.json").stat().st_size
    assert a.manifest_digest != b.manifest_digest
    assert _tree(b.snapshot) == _tree(root / "b") and _tree(a.snapshot) == _tree(root / "a")
    assert {s.digest for s in store.snapshots()} == {a.manifest_digest, b.manifest_digest}


def test_origin_changed_under_same_declared_revision_is_refetched(tmp_path: Path) -> None:
    """New bytes behind an unchanged "revision": "main" are a new revision: fetched, not reused."""
    root = tmp_path / "origin"
    generate_model(root / "m", 4 * MiB, 4, seed=3)
    write_http_manifest(root / "m", revision="main")
    store = NodeStore(tmp_path / "store", fsync=False)
    with nginx_origin(root) as o:
        url = o.url("m/preheat-manifest.json")
        v1 = store.pull(url)
        changed = rewrite_shard(root / "m", 1, seed=8)
        write_http_manifest(root / "m", revision="main")
        with pytest.raises(RevisionChanged):
            store.pull(url, revision=v1.revision)  # pinned to the old bytes: refused
        v2 = store.pull(url)
    assert v2.revision != v1.revision and v2.manifest_digest != v1.manifest_digest
    assert v2.bytes_fetched == changed.stat().st_size
    assert _tree(v2.snapshot) == _tree(root / "m")
    labels = {s.digest: s.labels for s in store.snapshots()}
    assert labels[v1.manifest_digest] == ("main",) and labels[v2.manifest_digest] == ("main",)


def test_file_source_changed_in_place_with_mtime_restored(tmp_path: Path) -> None:
    """A file:// file rewritten in place (same inode, size and mtime) is fetched again."""
    src = tmp_path / "src"
    generate_model(src, 2 * MiB, 2, seed=5)
    store = NodeStore(tmp_path / "store", fsync=False)
    r1 = store.pull(f"file://{src}")
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 64)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = shard.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )
    r2 = store.pull(f"file://{src}")
    assert r2.revision != r1.revision and r2.bytes_fetched == st.st_size
    assert _tree(r2.snapshot) == _tree(src)


def test_same_files_from_two_directories_share_one_snapshot(tmp_path: Path) -> None:
    """Identical bytes reached through two file:// sources give one snapshot (content decides)."""
    generate_model(tmp_path / "a", 2 * MiB, 2, seed=6)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    store = NodeStore(tmp_path / "store", fsync=False)
    a = store.pull(f"file://{tmp_path / 'a'}")
    b = store.pull(f"file://{tmp_path / 'b'}")
    assert a.manifest_digest == b.manifest_digest
    assert len(store.snapshots()) == 1
    assert sorted(store.snapshots()[0].refs) == sorted(
        [f"file://{tmp_path / 'a'}", f"file://{tmp_path / 'b'}"]
    )


OLD_REVISIONS = """
CREATE TABLE revisions (
    revision TEXT PRIMARY KEY, digest TEXT NOT NULL, ref TEXT NOT NULL, resolved REAL NOT NULL
);
"""


def test_store_db_from_before_is_migrated(tmp_path: Path) -> None:
    """A store.db whose revisions are keyed by revision alone is migrated in place."""
    src = tmp_path / "src"
    generate_model(src, 1 * MiB, 1, seed=7)
    store = NodeStore(tmp_path / "store", fsync=False)
    r = store.pull(f"file://{src}")
    with sqlite3.connect(store.layout.db) as con:  # rebuild the old (version 0) schema
        con.execute("DROP TABLE revisions")
        con.executescript(OLD_REVISIONS)
        con.execute(
            "INSERT INTO revisions VALUES (?,?,?,?)",
            ("main", r.manifest_digest, f"file://{src}", 1.0),
        )
        con.execute("PRAGMA user_version=0")
    again = NodeStore(tmp_path / "store")
    assert again.has("main") and again.has(r.manifest_digest)
    assert again.pull(f"file://{src}").bytes_fetched == 0
    with sqlite3.connect(store.layout.db) as con:
        con.execute("PRAGMA user_version=99")
    with pytest.raises(CacheError, match="schema version 99"):
        NodeStore(tmp_path / "store")
