"""The node agent's look at its store's ``snapshots/`` (``agent_store_watch.SnapshotWatch``)
against a real store under ``tmp_path``: a copy that joins or leaves the store, by any
process, is a change, seen at two looks in a row (the second one after the commit)."""

from __future__ import annotations

from pathlib import Path

from preheat.bench.models import generate_model
from preheat.runtime.kubernetes.agent_store_watch import SnapshotWatch
from preheat.store import NodeStore


def test_a_pull_and_an_eviction_by_another_store_user_are_changes(tmp_path: Path) -> None:
    """The first look records; a pull then an eviction, each through another ``NodeStore``
    on the same directory (another process, ``preheat cache evict``), are each reported
    at two looks, and nothing at the looks after them."""
    generate_model(tmp_path / "m", 200_000, shards=1, seed=3)
    watch = SnapshotWatch(NodeStore(tmp_path / "store", fsync=False).layout.snapshots)
    assert [watch.changed(), watch.changed()] == [False, False]
    other = NodeStore(tmp_path / "store", fsync=False)
    pulled = other.pull(f"file://{tmp_path / 'm'}")
    assert [watch.changed(), watch.changed(), watch.changed()] == [True, True, False]
    done = other.execute(other.plan_eviction(1))
    assert done.snapshots == (pulled.manifest_digest,)
    assert [watch.changed(), watch.changed(), watch.changed()] == [True, True, False]


def test_a_missing_directory_is_an_empty_store(tmp_path: Path) -> None:
    """A ``snapshots/`` not there (yet) lists nothing and raises nothing."""
    watch = SnapshotWatch(tmp_path / "absent" / "snapshots")
    assert [watch.changed(), watch.changed()] == [False, False]


def test_a_look_compares_with_what_the_last_reconcile_read(tmp_path: Path) -> None:
    """A copy published and then evicted between two looks is a change when a reconcile
    (``record``) read the store in between: the status that pass wrote lists the copy.
    (Compared with the previous look only, the two looks saw the same empty directory.)"""
    generate_model(tmp_path / "m", 200_000, shards=1, seed=4)
    store = NodeStore(tmp_path / "store", fsync=False)
    watch = SnapshotWatch(store.layout.snapshots)
    watch.record()  # a reconcile of the empty store
    assert watch.changed() is False
    store.pull(f"file://{tmp_path / 'm'}")
    watch.record()  # the reconcile the agent's own warm-up woke: it lists the copy
    NodeStore(tmp_path / "store", fsync=False).delete(store.snapshots()[0].digest)
    assert [watch.changed(), watch.changed(), watch.changed()] == [True, True, False]
