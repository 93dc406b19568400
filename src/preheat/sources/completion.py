"""A resolution's manifest with every sha256, for a caller that needs the snapshot's
digest before any node has pulled it (the Kubernetes operator pins an endpoint's
Deployment to it).

An origin may list a file without its sha256: a Hub repo's git files (config,
tokenizer: only a git blob id), a ``file://`` directory. Such files are read whole
from the source (the source verifies what it can, e.g. the git blob id) and hashed,
at most ``limit`` bytes in all; the result is the digest the node store gives the
snapshot once it holds it. Files the origin lists a sha256 for are not read.
"""

from __future__ import annotations

import hashlib

from preheat.artifacts.manifest import FileEntry, Manifest
from preheat.errors import ConfigError
from preheat.sources.base import Resolution, Source

__all__ = ["MAX_HASHED_BYTES", "complete_manifest"]

#: Enough for any set of Hub git files (each under 10 MiB); a source whose unhashed
#: files are bigger is weights without digests, not metadata.
MAX_HASHED_BYTES = 64 << 20


async def complete_manifest(
    src: Source, res: Resolution, *, limit: int = MAX_HASHED_BYTES
) -> Manifest:
    """``res.manifest`` with the sha256 of every file (see the module docstring)."""
    if res.manifest.complete:
        return res.manifest
    missing = [f for f in res.manifest.files if f.sha256 is None]
    total = sum(f.size for f in missing)
    if total > limit:
        raise ConfigError(
            f"{res.ref.display}: {len(missing)} file(s) without a sha256 at the origin "
            f"({total} bytes, over the {limit} bytes that are hashed to name the snapshot); "
            "publish a manifest with sha256s (preheat-manifest.json) for this source"
        )
    files = []
    for f in res.manifest.files:
        if f.sha256 is None:
            h = hashlib.sha256()
            async for chunk in src.fetch(res.locations[f.path], 0, f.size):
                h.update(chunk)
            f = FileEntry(f.path, f.size, h.hexdigest())
        files.append(f)
    return Manifest(tuple(files))
