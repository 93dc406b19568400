"""Publishing a verified fill: the partial file moved atomically into ``blobs/`` (an
existing blob kept), its resume state removed, and the directories that changed fsynced
once before the snapshot commits."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from preheat.store.layout import Layout

if TYPE_CHECKING:
    from preheat.store.fill import FillContext

__all__ = ["discard", "fsync_dirs", "publish_file", "publish_part"]


def publish_part(ctx: FillContext, part: Path, state: Path, digest: str) -> None:
    publish_file(ctx.layout, part, digest, ctx.dirty_dirs if ctx.fsync else None)
    with contextlib.suppress(FileNotFoundError):
        state.unlink()


def discard(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def publish_file(layout: Layout, src: Path, digest: str, dirty: set[Path] | None = None) -> Path:
    """Atomically move a verified file into ``blobs/`` (keeping an existing blob).

    The directory that changed is added to ``dirty``; the caller fsyncs those once,
    before it commits the snapshot (a directory fsync forces a journal commit, far too
    slow to do per blob on the event loop)."""
    dest = layout.blob(digest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        src.unlink()
        return dest
    os.replace(src, dest)
    if dirty is not None:
        dirty.add(dest.parent)
    return dest


def fsync_dirs(dirs: set[Path]) -> None:
    """fsync each directory (makes renames into them durable)."""
    for d in sorted(dirs):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
