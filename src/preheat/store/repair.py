"""Repair: re-fetch a corrupt or changed blob from the origin and re-link its snapshots.

Used by ``verify`` (a blob whose bytes no longer hash to its digest) and by ``lease`` (a
blob whose size, mtime or ctime moved since the store linked it: a replica wrote into
its snapshot, and 0444 does not stop root). The origin is found through the resolutions
recorded for the snapshots that use the blob (``revisions``: ref and S3 endpoint). The
bad file moves to ``quarantine/``, a verified copy is fetched into ``blobs/``, and every
snapshot path that used the blob is replaced by a link to the new file (``os.replace``:
readers see the old or the new file, never a missing one).

A blob no origin can give back (origin gone, or changed: the digest no longer matches)
stays in ``quarantine/``: snapshots nobody leases are dropped, leased ones are kept with
their leases (and reported) but their resolutions are forgotten, so the next pull fetches
the blob again and re-links them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from preheat.artifacts.manifest import Manifest
from preheat.artifacts.refs import parse_ref, redact_url
from preheat.errors import FetchError, PreheatError
from preheat.sources.base import open_source
from preheat.store.db import Db
from preheat.store.fill import FillContext, FillStats, Slots, fetch_blob, lock_file, unlock_file
from preheat.store.layout import Layout

T = TypeVar("T")


@dataclass(frozen=True)
class Repair:
    """What became of one bad blob."""

    digest: str
    repaired: bool
    origin: str | None  # the ref (redacted) it was fetched from again
    snapshots: tuple[str, ...]  # snapshots that use it
    holders: tuple[str, ...]  # lease holders of those snapshots
    reason: str = ""  # why it could not be repaired


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even inside a running event loop."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="preheat-repair") as ex:
        return ex.submit(asyncio.run, coro).result()


def stat_of(path: os.PathLike[str] | str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def relink(layout: Layout, snapshot: str, manifest: Manifest, digest: str) -> None:
    """Point every path of ``snapshot`` whose content is ``digest`` at the blob file."""
    blob = layout.blob(digest)
    base = layout.snapshot(snapshot)
    for f in manifest.files:
        if f.sha256 != digest:
            continue
        dest = layout.inside(base, f.path)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(dest).st_ino == os.stat(blob).st_ino:
                continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.relink")
        os.link(blob, tmp)
        os.replace(tmp, dest)


def record_stat(db: Db, layout: Layout, digest: str) -> None:
    st = stat_of(layout.blob(digest))
    if st is not None:
        with db.write() as tx:
            tx.set_blob_stat(digest, *st)


async def _fetch_again(db: Db, layout: Layout, digest: str, size: int) -> tuple[str | None, str]:
    """Fetch ``digest`` from an origin that recorded it; (origin, "") or (None, reason)."""
    with db.read() as tx:
        users = tx.snapshots_with_blob(digest)
        tried: list[tuple[str, str | None, Manifest]] = []
        for s in users:
            text = tx.manifest_json(s)
            if text is None:
                continue
            m = Manifest.from_json(text)
            for ref, endpoint in tx.origins(s):
                if all((ref, endpoint) != (r, e) for r, e, _ in tried):
                    tried.append((ref, endpoint, m))
    if not tried:
        return None, "no origin is recorded for the snapshots that use it"
    reasons = []
    for ref, endpoint, manifest in tried:
        paths = [f.path for f in manifest.files if f.sha256 == digest]
        try:
            src = open_source(parse_ref(ref), endpoint_url=endpoint, connections=4)
        except PreheatError as exc:
            reasons.append(f"{redact_url(ref)}: {exc}")
            continue
        executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="preheat-repair")
        try:
            res = await src.resolve()
            path = next((p for p in paths if p in res.locations), None)
            if path is None:
                reasons.append(f"{redact_url(ref)} no longer lists {paths[0]!r}")
                continue
            ctx = FillContext(
                source=src,
                layout=layout,
                connections=Slots(4),
                executor=executor,
                stats=FillStats(total=size),
                retries=2,
                backoff=0.1,
            )
            key = f"repair-{digest}"
            lock = await lock_file(layout.tmp / f"{key}.lock")
            try:
                await fetch_blob(ctx, path, res.locations[path], size, digest, key)
            finally:
                unlock_file(lock)
            return redact_url(ref), ""
        except (PreheatError, OSError) as exc:
            kind = "origin" if isinstance(exc, FetchError) else "fetch"
            reasons.append(f"{redact_url(ref)} ({kind}): {redact_url(str(exc))}")
        finally:
            executor.shutdown(wait=False)
            await src.aclose()
    return None, "; ".join(reasons)


def repair_blob(db: Db, layout: Layout, digest: str) -> Repair:
    """Quarantine the bad file of ``digest``, fetch it again and re-link its snapshots.

    On failure the file stays in quarantine and the caller decides about the snapshots."""
    with db.read() as tx:
        users = tuple(tx.snapshots_with_blob(digest))
        holders = tuple(dict.fromkeys(h for s in users for h in tx.holders(s)))
        size = tx.blob_size(digest)
        manifests = {s: tx.manifest_json(s) for s in users}
    src = layout.blob(digest)
    if size is None:
        st = stat_of(src)
        size = st[0] if st else 0
    if src.exists():
        os.replace(src, layout.quarantine / f"{digest}.{time.time_ns()}")
    origin, reason = run_sync(_fetch_again(db, layout, digest, size))
    if origin is None:
        return Repair(digest, False, None, users, holders, reason)
    for s, text in manifests.items():
        if text is not None and layout.snapshot(s).is_dir():
            relink(layout, s, Manifest.from_json(text), digest)
    record_stat(db, layout, digest)
    return Repair(digest, True, origin, users, holders)


def check_snapshot(db: Db, layout: Layout, snapshot: str) -> list[Repair]:
    """Before a lease: every blob of ``snapshot`` still has the size, mtime and ctime the
    store recorded, and every snapshot path is a link to its blob. A blob that moved is
    re-hashed: unchanged bytes get the new stat recorded (links re-made), changed bytes
    are fetched again (``repair_blob``). Returns the repairs made; raises ``CacheError``
    when a changed blob cannot be fetched again."""
    from preheat.errors import CacheError
    from preheat.store.verify import hash_file

    with db.read() as tx:
        text = tx.manifest_json(snapshot)
        assert text is not None
        manifest = Manifest.from_json(text)
        recorded = {f.sha256: tx.blob_stat(f.sha256) for f in manifest.files if f.sha256}
    base = layout.snapshot(snapshot)
    suspects: set[str] = set()
    for f in manifest.files:
        assert f.sha256 is not None
        try:
            linked = (
                os.stat(layout.inside(base, f.path)).st_ino == os.stat(layout.blob(f.sha256)).st_ino
            )
        except FileNotFoundError:
            linked = False
        if not linked or stat_of(layout.blob(f.sha256)) != recorded[f.sha256]:
            suspects.add(f.sha256)
    repairs = []
    for digest in sorted(suspects):
        if hash_file(layout.blob(digest)) == digest:
            relink(layout, snapshot, manifest, digest)
            record_stat(db, layout, digest)
            continue
        r = repair_blob(db, layout, digest)
        if not r.repaired:
            raise CacheError(
                f"snapshot {snapshot[:16]}: blob {digest[:16]} changed on disk (a replica "
                f"wrote into its snapshot?) and cannot be fetched again: {r.reason}; "
                "it is in quarantine/, pull the model again"
            )
        repairs.append(r)
    return repairs
