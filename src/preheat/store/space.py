"""Space: usage, reservations made before a fill, and carrying out eviction plans.

A fill reserves the bytes it will write before it fetches any; when the store is short,
an eviction plan (``store.evict.plan_eviction``) frees room first, and when even evicting
everything evictable is not enough the fill is refused with ``InsufficientSpace`` and the
numbers. A warm-up's fill passes ``spare`` (the warmed copies no replica has used yet,
``runtime.warm_room``): its eviction plan, made under the same write lock as the
reservation, never takes those, so no other fill can slip in between a warm-up's eviction
and its reservation; when only spared copies could make the room it is refused with
``WarmupDeferred`` (retried later) instead. Blobs a fill in flight needs are recorded with its reservation, so no other
eviction takes them. Execution removes pointers first (DB rows, snapshot directories)
and blobs last.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from preheat.artifacts.refs import redact_url
from preheat.config import format_size
from preheat.errors import InsufficientSpace, WarmupDeferred
from preheat.store.db import Db
from preheat.store.db_tx import Tx
from preheat.store.evict import EvictionPlan, plan_eviction
from preheat.store.layout import Layout
from preheat.store.results import Usage


@dataclass
class Reservation:
    """Bytes and blobs one fill holds until its snapshot is committed.

    The owner holds an exclusive ``flock`` on ``tmp/reservation-<id>.lock`` for as long as
    the reservation lives; a reservation whose lock nobody holds belongs to a process that
    died and is dropped. (A PID would not do: a store on a hostPath is shared by processes
    in different PID namespaces, and PIDs are reused.)"""

    id: str
    lock: Path
    fd: int


def _owner_gone(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return True


def empty_trash(trash: list[Path]) -> None:
    """Delete snapshot directories an eviction renamed away (after its commit)."""
    for d in trash:
        shutil.rmtree(d, ignore_errors=True)


def _refusal(ref: str, need: int, u: Usage, evictable: int) -> InsufficientSpace:
    cap = (
        f"capacity {format_size(u.capacity)} x high watermark {u.high_watermark:.0%}"
        if u.capacity
        else "no capacity set"
    )
    err = InsufficientSpace(
        f"cannot pull {redact_url(ref)}: it needs {format_size(need)} ({need} bytes) but only "
        f"{format_size(u.free)} is free ({cap}; {format_size(u.used)} used, "
        f"{format_size(u.reserved)} reserved by fills in flight, "
        f"{format_size(u.disk_free)} free on disk), and evicting every "
        f"unpinned, unleased snapshot frees only {format_size(evictable)}. "
        "Raise --capacity, unpin or release snapshots, or free disk space."
    )
    err.need, err.free, err.evictable = need, u.free, evictable
    return err


def _deferred(ref: str, need: int, u: Usage, evictable: int, kept: int, n: int) -> WarmupDeferred:
    err = WarmupDeferred(
        f"warming {redact_url(ref)} needs {format_size(need - u.free)} more room and only "
        f"{format_size(evictable)} is evictable without {n} warmed "
        f"cop{'y' if n == 1 else 'ies'} no replica has used yet ({format_size(kept)}); a "
        "warm-up never evicts those; retried later (a replica's use frees them for "
        "eviction), or raise the node's capacity"
    )
    err.need, err.free, err.evictable = need - u.free, u.free, evictable
    return err


class Space:
    """Capacity accounting and eviction for one store."""

    def __init__(self, db: Db, layout: Layout, capacity: int | None, high_watermark: float) -> None:
        self.db = db
        self.layout = layout
        self.capacity = capacity
        self.high_watermark = high_watermark

    def usage_in(self, tx: Tx, *, on_disk: int = 0) -> Usage:
        """Usage now; ``free`` is for a fill of which ``on_disk`` bytes are files already
        on this filesystem that it links rather than writes (the disk has their room
        already; the capacity counts them like any other reserved bytes)."""
        used = tx.used_bytes()
        reserved = tx.reserved_bytes()
        st = os.statvfs(self.layout.root)
        disk_free = st.f_bavail * st.f_frsize
        free = disk_free - reserved + on_disk
        if self.capacity is not None:
            free = min(free, int(self.capacity * self.high_watermark) - used - reserved)
        return Usage(self.capacity, self.high_watermark, used, reserved, disk_free, max(0, free))

    def usage(self) -> Usage:
        with self.db.read() as tx:
            return self.usage_in(tx)

    def plan(self, free_bytes: int) -> EvictionPlan:
        with self.db.read() as tx:
            return plan_eviction(tx.infos(), tx.blob_sizes(), free_bytes, tx.protected_blobs())

    def reserve(
        self,
        ref: str,
        need: int,
        present: Iterable[str],
        *,
        on_disk: int = 0,
        spare: frozenset[str] = frozenset(),
    ) -> Reservation:
        """Reserve ``need`` bytes, evicting by plan if needed; refuse with the numbers if even
        evicting everything evictable would not make room. Blobs in ``present`` are
        protected from every eviction (this pull links them) until ``release``. Of
        ``need``, ``on_disk`` bytes are files already on the store's filesystem that the
        fill links into ``blobs/`` (staged tar members, see ``sources.oci_stage``): the
        disk's free space need not hold them again, the capacity still counts them.
        ``spare``: snapshot digests the eviction must not take (a warm-up's fill, module
        docstring); ``WarmupDeferred`` when only they could make the room."""
        rid = uuid.uuid4().hex
        keep = set(present)
        lock = self.layout.tmp / f"reservation-{rid}.lock"
        trash: list[Path] = []
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with self.db.write() as tx:
                for r, _pid in tx.reservations():
                    path = self.layout.tmp / f"reservation-{r}.lock"
                    if _owner_gone(path):
                        tx.drop_reservation(r)
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
                u = self.usage_in(tx, on_disk=min(max(0, on_disk), need))
                if need > u.free:
                    self._evict_for(tx, ref, need, u, keep, spare, trash)
                tx.add_reservation(rid, need, os.getpid(), keep)
        except BaseException:
            os.close(fd)
            lock.unlink()
            raise
        finally:
            empty_trash(trash)
        return Reservation(rid, lock, fd)

    def _evict_for(
        self,
        tx: Tx,
        ref: str,
        need: int,
        u: Usage,
        keep: set[str],
        spare: frozenset[str],
        trash: list[Path],
    ) -> None:
        """Evict by plan (sparing ``spare``) so ``need`` bytes fit, or refuse (in ``tx``)."""
        infos, sizes = tx.infos(), tx.blob_sizes()
        protected = keep | tx.protected_blobs()
        plan = plan_eviction(infos, sizes, need - u.free, protected, spare)
        if not plan.enough:
            full = plan if not spare else plan_eviction(infos, sizes, need - u.free, protected)
            if full.enough:
                kept = [s for s in infos if s.digest in spare and s.evictable]
                size = sum(s.size for s in kept)
                raise _deferred(ref, need, u, plan.frees, size, len(kept))
            raise _refusal(ref, need, u, full.frees)
        self.execute_in(tx, plan, trash)

    def protect(self, res: Reservation, digest: str, size: int, fingerprint: str) -> bool:
        """Record a blob this fill has (fetched or found) under its reservation: protected
        from eviction, its bytes now counted as used instead of reserved. False when the
        blob file is not there (evicted before it could be protected)."""
        with self.db.write() as tx:
            tx.record_blob(digest, size, fingerprint)
            tx.protect_blob(res.id, digest, size)
        return self.layout.blob(digest).exists()

    def hand_over(self, res: Reservation, n: int) -> None:
        """Stop counting ``n`` of ``res``'s bytes: another reservation of this process
        counts them now (a staged tar member a fill links into ``blobs/``, reserved by the
        fill, see ``sources.oci_stage``), so they are not reserved twice."""
        with self.db.write() as tx:
            tx.shrink_reservation(res.id, n)

    def release(self, res: Reservation | None, *, dropped: bool = False) -> None:
        """Drop the reservation (``dropped``: the caller's transaction already did, with
        the snapshot commit), then its lock."""
        if res is None:
            return
        try:
            if not dropped:
                with self.db.write() as tx:
                    tx.drop_reservation(res.id)
        finally:
            # even when the row could not be dropped (a full disk): with its lock gone
            # the next reservation drops it
            with contextlib.suppress(FileNotFoundError):
                res.lock.unlink()
            os.close(res.fd)

    def execute(self, plan: EvictionPlan) -> EvictionPlan:
        trash: list[Path] = []
        try:
            with self.db.write() as tx:
                return self.execute_in(tx, plan, trash)
        finally:
            empty_trash(trash)

    def execute_in(self, tx: Tx, plan: EvictionPlan, trash: list[Path]) -> EvictionPlan:
        """Carry out ``plan`` in ``tx``; snapshot directories are renamed into ``trash``
        (the caller removes them after the commit, outside the write lock)."""
        done_snaps: list[str] = []
        for d in plan.snapshots:
            pinned = tx.pinned(d)
            if pinned is None or pinned or tx.leased(d):
                continue
            self.drop_snapshot(tx, d, trash)
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

    def drop_snapshot(self, tx: Tx, digest: str, trash: list[Path]) -> None:
        """Pointers first: the DB rows, then the snapshot directory, renamed into
        ``tmp/trash-*`` so it vanishes atomically (``empty_trash`` deletes it later; a
        crash before that leaves it to ``clean_tmp``)."""
        tx.drop_snapshot(digest)
        path = self.layout.snapshot(digest)
        if path.exists():
            dest = self.layout.tmp / f"trash-{digest[:16]}-{uuid.uuid4().hex[:8]}"
            os.rename(path, dest)
            trash.append(dest)

    def drop_blob(self, tx: Tx, digest: str) -> None:
        tx.drop_blob(digest)
        with contextlib.suppress(FileNotFoundError):
            self.layout.blob(digest).unlink()
