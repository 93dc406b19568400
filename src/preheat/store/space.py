"""Space: usage, reservations made before a fill, and carrying out eviction plans.

A fill reserves the bytes it will write before it fetches any; when the store is short,
an eviction plan (``store.evict.plan_eviction``) frees room first, and when even evicting
everything evictable is not enough the fill is refused with ``InsufficientSpace`` and the
numbers. Blobs a fill in flight needs are recorded with its reservation, so no other
eviction takes them. Execution removes pointers first (DB rows, snapshot directories)
and blobs last.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterable

from preheat.config import format_size
from preheat.errors import InsufficientSpace
from preheat.store.db import Db, Tx
from preheat.store.evict import EvictionPlan, plan_eviction
from preheat.store.layout import Layout
from preheat.store.results import Usage


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Space:
    """Capacity accounting and eviction for one store."""

    def __init__(self, db: Db, layout: Layout, capacity: int | None, high_watermark: float) -> None:
        self.db = db
        self.layout = layout
        self.capacity = capacity
        self.high_watermark = high_watermark

    def usage_in(self, tx: Tx) -> Usage:
        used = tx.used_bytes()
        reserved = tx.reserved_bytes()
        st = os.statvfs(self.layout.root)
        disk_free = st.f_bavail * st.f_frsize
        free = disk_free - reserved
        if self.capacity is not None:
            free = min(free, int(self.capacity * self.high_watermark) - used - reserved)
        return Usage(self.capacity, self.high_watermark, used, reserved, disk_free, max(0, free))

    def usage(self) -> Usage:
        with self.db.read() as tx:
            return self.usage_in(tx)

    def plan(self, free_bytes: int) -> EvictionPlan:
        with self.db.read() as tx:
            return plan_eviction(tx.infos(), tx.blob_sizes(), free_bytes, tx.protected_blobs())

    def reserve(self, ref: str, need: int, present: Iterable[str]) -> str | None:
        """Reserve ``need`` bytes, evicting by plan if needed; refuse with the numbers if even
        evicting everything evictable would not make room. Blobs in ``present`` are
        protected from that eviction (this pull links them)."""
        rid = uuid.uuid4().hex
        keep = set(present)
        with self.db.write() as tx:
            for r, pid in tx.reservations():
                if not _pid_alive(pid):
                    tx.drop_reservation(r)
            u = self.usage_in(tx)
            if need > u.free:
                protected = keep | tx.protected_blobs()
                plan = plan_eviction(tx.infos(), tx.blob_sizes(), need - u.free, protected)
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
                self.execute_in(tx, plan)
            if need or keep:
                tx.add_reservation(rid, need, os.getpid(), keep)
                return rid
        return None

    def release(self, rid: str | None) -> None:
        if rid is None:
            return
        with self.db.write() as tx:
            tx.drop_reservation(rid)

    def execute(self, plan: EvictionPlan) -> EvictionPlan:
        with self.db.write() as tx:
            return self.execute_in(tx, plan)

    def execute_in(self, tx: Tx, plan: EvictionPlan) -> EvictionPlan:
        done_snaps: list[str] = []
        for d in plan.snapshots:
            pinned = tx.pinned(d)
            if pinned is None or pinned or tx.leased(d):
                continue
            self.drop_snapshot(tx, d)
            done_snaps.append(d)
        protected = tx.protected_blobs()
        done_blobs: list[str] = []
        frees = 0
        for b in plan.blobs:
            if b in protected or tx.blob_in_use(b):
                continue
            size = tx.blob_size(b)
            self.drop_blob(tx, b)
            done_blobs.append(b)
            frees += size or 0
        return EvictionPlan(plan.need, tuple(done_snaps), tuple(done_blobs), frees)

    def drop_snapshot(self, tx: Tx, digest: str) -> None:
        """Pointers first: the DB rows, then the snapshot directory (renamed away first so
        it vanishes atomically)."""
        tx.drop_snapshot(digest)
        path = self.layout.snapshot(digest)
        if path.exists():
            trash = self.layout.tmp / f"trash-{digest[:16]}-{uuid.uuid4().hex[:8]}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def drop_blob(self, tx: Tx, digest: str) -> None:
        tx.drop_blob(digest)
        with contextlib.suppress(FileNotFoundError):
            self.layout.blob(digest).unlink()
