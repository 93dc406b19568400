"""Paths of a node store on disk, and the check that every derived path stays inside it.

::

    <root>/blobs/sha256/<2 hex>/<64 hex>       immutable, read-only blob files
    <root>/snapshots/<manifest digest>/<path>   hard links to blobs: what a replica reads
    <root>/refs/<artifact key>/latest           the revision a ref resolved to last (JSON)
    <root>/refs/<artifact key>/history.jsonl    every resolution (audit trail)
    <root>/tmp/                                 partial downloads + their range state, locks
    <root>/quarantine/                          blobs that failed verification
    <root>/store.db                             sqlite metadata
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from preheat.artifacts.manifest import check_relpath
from preheat.errors import UnsafePath

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def blobs(self) -> Path:
        return self.root / "blobs" / "sha256"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def refs(self) -> Path:
        return self.root / "refs"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def db(self) -> Path:
        return self.root / "store.db"

    def ensure(self) -> None:
        for d in (self.blobs, self.snapshots, self.refs, self.tmp, self.quarantine):
            d.mkdir(parents=True, exist_ok=True)

    def blob(self, digest: str) -> Path:
        if not _HEX64.match(digest):
            raise UnsafePath(f"blob digest {digest!r} is not 64 lowercase hex characters")
        return self.blobs / digest[:2] / digest

    def snapshot(self, manifest_digest: str) -> Path:
        if not _HEX64.match(manifest_digest):
            raise UnsafePath(f"snapshot digest {manifest_digest!r} is not 64 hex characters")
        return self.snapshots / manifest_digest

    def inside(self, base: Path, relpath: str) -> Path:
        """``base / relpath`` after checking the result cannot leave ``base``."""
        check_relpath(relpath)
        out = base / relpath
        if os.path.commonpath([os.path.normpath(out), os.path.normpath(base)]) != os.path.normpath(
            base
        ):
            raise UnsafePath(f"path {relpath!r} escapes {base}")
        return out
