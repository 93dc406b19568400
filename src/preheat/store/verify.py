"""Housekeeping: re-hash every blob (``verify``) and clean leftovers in ``tmp/``."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from preheat.store.db import Db
from preheat.store.layout import Layout
from preheat.store.repair import Repair, repair_blob
from preheat.store.results import VerifyReport
from preheat.store.space import Space, empty_trash


def hash_file(path: os.PathLike[str] | str) -> str | None:
    """sha256 of a file's bytes, or None when it is missing."""
    h = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    except FileNotFoundError:
        return None
    return h.hexdigest()


def clean_tmp(layout: Layout, *, partial_max_age: float, work_max_age: float) -> int:
    """Remove snapshot work dirs and trash older than ``work_max_age`` s, and partial
    downloads nobody holds the lock of, last touched more than ``partial_max_age`` s ago."""
    now = time.time()
    removed = 0
    for p in layout.tmp.iterdir():
        try:
            age = now - p.lstat().st_mtime
        except FileNotFoundError:
            continue
        if p.suffix == ".new" and age > work_max_age:  # a range list a crash left
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            removed += 1
        elif p.is_dir() and p.name.startswith(("snap-", "trash-")) and age > work_max_age:
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


def verify(db: Db, layout: Layout, space: Space, *, quarantine: bool, workers: int) -> VerifyReport:
    """Re-hash every blob. A corrupt (or missing) blob is fetched again from an origin
    recorded for its snapshots and re-linked into them (``store.repair``); one that cannot
    be repaired stays in ``quarantine/``: unleased snapshots using it are removed (pointers
    first), leased ones keep their leases and are reported with their holders."""
    t0 = time.monotonic()
    cleaned = clean_tmp(layout, partial_max_age=86400.0, work_max_age=600.0) if quarantine else 0
    with db.read() as tx:
        blobs = tx.blob_sizes()
        infos = tx.infos()
    for p in layout.blobs.glob("??/*"):
        blobs.setdefault(p.name, p.stat().st_size)

    def check(digest: str) -> tuple[str, str | None]:
        actual = hash_file(layout.blob(digest))
        if actual is None:
            return digest, "missing"
        return digest, None if actual == digest else actual

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(check, sorted(blobs)))
    corrupt = tuple((d, a) for d, a in results if a is not None)
    missing = tuple(s.digest for s in infos if not layout.snapshot(s.digest).is_dir())
    removed: list[str] = []
    repairs: list[Repair] = []
    trash: list[Path] = []
    if quarantine:
        used = {b for s in infos for b in s.blobs}
        for d, _actual in corrupt:
            if d in used:
                repairs.append(repair_blob(db, layout, d))
            else:  # nothing links it: just drop it
                with db.write() as tx:
                    tx.drop_blob(d)
                src = layout.blob(d)
                if src.exists():
                    os.replace(src, layout.quarantine / f"{d}.{time.time_ns()}")
        broken = {s for r in repairs if not r.repaired for s in r.snapshots}
        with db.write() as tx:
            for r in repairs:
                if not r.repaired:
                    tx.drop_blob(r.digest)
            for d in sorted(broken | set(missing)):
                if tx.leased(d) and d not in missing:
                    tx.drop_revisions(d)  # kept for its replicas; the next pull re-links it
                    continue
                space.drop_snapshot(tx, d, trash)
                removed.append(d)
    empty_trash(trash)
    return VerifyReport(
        checked=len(blobs),
        bytes=sum(blobs.values()),
        corrupt=corrupt,
        removed_snapshots=tuple(removed),
        missing_snapshots=missing,
        seconds=time.monotonic() - t0,
        cleaned_tmp=cleaned,
        repairs=tuple(repairs),
    )
