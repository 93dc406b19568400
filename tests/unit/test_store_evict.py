"""Eviction planning (pure): priority then least recent use; never pinned or leased."""

from __future__ import annotations

from preheat.store.evict import SnapshotInfo, eviction_order, plan_eviction


def snap(
    d: str,
    blobs: set[str],
    last_use: float,
    *,
    pinned: bool = False,
    leases: tuple[str, ...] = (),
    priority: int = 0,
) -> SnapshotInfo:
    return SnapshotInfo(
        digest=d,
        size=0,
        files=len(blobs),
        created=0.0,
        last_use=last_use,
        pinned=pinned,
        leases=leases,
        priority=priority,
        blobs=frozenset(blobs),
    )


SIZES = {"a": 100, "b": 100, "c": 100, "s": 50, "o": 10}


def test_least_recent_first() -> None:
    """With equal priority the oldest snapshot goes first, and only as many as needed."""
    snaps = [snap("new", {"a"}, 30), snap("old", {"b"}, 10), snap("mid", {"c"}, 20)]
    plan = plan_eviction(snaps, {k: SIZES[k] for k in "abc"}, 150)
    assert plan.snapshots == ("old", "mid")
    assert set(plan.blobs) == {"b", "c"} and plan.frees == 200 and plan.enough


def test_priority_beats_recency() -> None:
    """A high-priority snapshot outlives a more recently used low-priority one."""
    snaps = [snap("important", {"a"}, 1, priority=10), snap("recent", {"b"}, 99)]
    assert plan_eviction(snaps, {"a": 100, "b": 100}, 50).snapshots == ("recent",)


def test_leased_and_pinned_never_chosen() -> None:
    """Even when the plan cannot free enough, leased and pinned snapshots are left alone."""
    snaps = [
        snap("leased", {"a"}, 1, leases=("replica-1",)),
        snap("pinned", {"b"}, 2, pinned=True),
        snap("free", {"c"}, 3),
    ]
    plan = plan_eviction(snaps, {k: SIZES[k] for k in "abc"}, 10_000)
    assert plan.snapshots == ("free",)
    assert not plan.enough and plan.frees == 100
    assert [s.digest for s in eviction_order(snaps)] == ["free"]


def test_shared_blobs_freed_only_with_last_user() -> None:
    """A blob two snapshots share is freed only when both go; a kept snapshot keeps it."""
    snaps = [snap("v1", {"a", "s"}, 1), snap("v2", {"b", "s"}, 2, leases=("r",))]
    plan = plan_eviction(snaps, {"a": 100, "b": 100, "s": 50}, 120)
    assert plan.snapshots == ("v1",)
    assert plan.blobs == ("a",) and plan.frees == 100 and not plan.enough


def test_orphans_first_and_protected_blobs_kept() -> None:
    """Unreferenced blobs go before any snapshot; blobs a fill in flight needs stay."""
    snaps = [snap("v1", {"a"}, 1)]
    plan = plan_eviction(snaps, {"a": 100, "o": 10, "p": 10}, 15, protected={"p"})
    assert plan.blobs[0] == "o" and "p" not in plan.blobs
    assert plan.snapshots == ("v1",)


def test_nothing_needed_is_empty_plan() -> None:
    """Asking for zero bytes plans nothing."""
    plan = plan_eviction([snap("v1", {"a"}, 1)], {"a": 100}, 0)
    assert plan.empty and plan.enough


def test_spared_snapshots_are_not_candidates() -> None:
    """``spare`` (a warm-up's fill sparing unused warmed copies) skips those snapshots even
    when they are oldest, and a plan that only they could complete is not enough."""
    snaps = [snap("old", {"a"}, 10), snap("mid", {"b"}, 20), snap("new", {"c"}, 30)]
    sizes = {k: SIZES[k] for k in "abc"}
    plan = plan_eviction(snaps, sizes, 150, spare={"old"})
    assert plan.snapshots == ("mid", "new") and set(plan.blobs) == {"b", "c"}
    short = plan_eviction(snaps, sizes, 250, spare={"old"})
    assert not short.enough and short.frees == 200 and "old" not in short.snapshots
