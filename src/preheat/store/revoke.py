"""The store's revocation list: digests and revisions that must not be served or pulled.

``revoke(key)`` records ``key`` (a blob or image digest, a snapshot digest, or a model
revision) and removes what the store holds of it: every snapshot that is that digest,
was resolved from that revision, or links that blob, and then the blobs no remaining
snapshot uses; a tar layer's digest also matches the snapshots unpacked from it (the
revisions its ``oci-layers/users-<hex>.json`` lists). A snapshot leased by a running replica (or referenced by an endpoint's
image) is kept for its holders and reported: the revocation refuses every *new* pull of
it (rolling the holders to another version is the fleet's job, not built yet). Until
``unrevoke``, every pull whose revision, snapshot digest or any file digest is on the list fails with
``Revoked`` before a byte is fetched (``refuse_revoked``, called from ``store.pull``).

Keys are normalised: ``<64 hex>`` and ``sha256:<64 hex>`` are the same key.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from preheat.artifacts.refs import ArtifactRef
from preheat.errors import ConfigError, Revoked
from preheat.sources.base import Resolution
from preheat.store.db import Db
from preheat.store.evict import EvictionPlan
from preheat.store.space import Space, empty_trash

_HEX = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


def normalise(key: str) -> str:
    """``sha256:<hex>`` for a digest in either spelling; any other revision as written."""
    key = key.strip()
    if not key:
        raise ConfigError("revocation key is empty; pass a digest (sha256:<hex>) or a revision")
    m = _HEX.match(key)
    return f"sha256:{m.group(1)}" if m else key


@dataclass(frozen=True)
class RevokeReport:
    key: str
    removed: tuple[str, ...]  # snapshot digests removed
    kept: tuple[tuple[str, tuple[str, ...]], ...]  # (snapshot, its holders) kept for them
    blobs: tuple[str, ...]  # blob digests removed


def revoke(db: Db, space: Space, key: str, reason: str = "") -> RevokeReport:
    """Record ``key`` as revoked and remove what the store holds of it."""
    key = normalise(key)
    hexd = key.removeprefix("sha256:") if _HEX.match(key) else None
    trash: list[Path] = []
    removed: list[str] = []
    kept: list[tuple[str, tuple[str, ...]]] = []
    try:
        with db.write() as tx:
            tx.revoke(key, reason or "revoked")
            hit: set[str] = set()
            built = _built_from(db.path.parent, hexd)
            for s in tx.infos():
                if (
                    s.digest == hexd
                    or key in s.revisions
                    or (hexd is not None and hexd in s.blobs)
                    or built.intersection(s.revisions)
                ):
                    hit.add(s.digest)
            blobs: set[str] = set()
            for d in sorted(hit):
                holders = tuple(tx.holders(d))
                if holders:
                    kept.append((d, holders))
                    continue
                blobs |= set(tx.snapshot_blobs(d))
                space.drop_snapshot(tx, d, trash)
                removed.append(d)
            if hexd is not None and tx.blob_size(hexd) is not None:
                blobs.add(hexd)
            plan = EvictionPlan(0, (), tuple(sorted(blobs)), 0)
            done = space.execute_in(tx, plan, trash)
            tx.drop_orphan_images()
    finally:
        empty_trash(trash)
    return RevokeReport(key, tuple(removed), tuple(kept), done.blobs)


def _built_from(root: Path, hexd: str | None) -> set[str]:
    """Revisions whose snapshots were unpacked from the tar layer ``hexd`` (OCI sources
    record them in ``oci-layers/users-<hex>.json``, ``sources.oci_stage.record_users``)."""
    if hexd is None:
        return set()
    try:
        raw = json.loads((root / "oci-layers" / f"users-{hexd}.json").read_text())
    except (FileNotFoundError, ValueError):
        return set()
    return {str(r) for r in raw} if isinstance(raw, list) else set()


def unrevoke(db: Db, key: str) -> bool:
    """Allow ``key`` again; False when it was not revoked."""
    with db.write() as tx:
        return tx.unrevoke(normalise(key))


def revoked(db: Db) -> dict[str, tuple[str, float]]:
    with db.read() as tx:
        return tx.revoked()


def refuse_revoked(db: Db, ref: ArtifactRef, res: Resolution) -> None:
    """Raise ``Revoked`` when the resolution's revision, snapshot or any file is revoked."""
    with db.read() as tx:
        listed = tx.revoked()
    if not listed:
        return
    keys = [normalise(res.revision)]
    if res.manifest.complete:
        keys.append(f"sha256:{res.manifest.digest}")
    keys += [f"sha256:{f.sha256}" for f in res.manifest.files if f.sha256]
    for k in keys:
        if k in listed:
            reason, since = listed[k]
            when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(since))
            raise Revoked(
                f"{ref.display} is revoked: {k} is on this store's revocation list since "
                f"{when} ({reason}); nothing was fetched. Pull another version, or allow it "
                f"again with `preheat image unrevoke {k} --store {db.path.parent}` (one "
                "list for images and models)"
            )
