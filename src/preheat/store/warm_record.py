"""Warmed copies a store remembers across restarts: which snapshots a warm-up published
and their ``last_use`` then (``runtime.warm_room`` spares the ones no replica has used).

One small JSON file per copy, ``<root>/warm/<manifest digest>`` = ``{"last_use": t,
"warmed_at": t}``, written to ``tmp/`` and renamed into place, so a reader never sees
half a record and several processes sharing the store (``preheat up`` restarted, the node
agent and a new agent pod) agree. A copy is *unused* while it is still in the store, no
one holds a lease on it and its ``last_use`` has not moved since the record (a replica's
lease or pull of it moves it). Records of snapshots that are gone are removed when read.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from preheat.store.evict import SnapshotInfo

__all__ = ["WarmRecord"]


class WarmRecord:
    """The warm-up records of the store rooted at ``root`` (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "warm"
        self._tmp = Path(root) / "tmp"

    def mark(self, info: SnapshotInfo) -> None:
        """A warm-up published ``info`` (its ``last_use`` as the store has it now)."""
        self.dir.mkdir(exist_ok=True)
        tmp = self._tmp / f"warm-{info.digest[:16]}-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps({"last_use": info.last_use, "warmed_at": time.time()}))
        os.replace(tmp, self.dir / info.digest)

    def recorded(self) -> dict[str, float]:
        """Manifest digest -> its ``last_use`` when a warm-up published it."""
        out: dict[str, float] = {}
        with contextlib.suppress(FileNotFoundError):
            for path in self.dir.iterdir():
                try:
                    out[path.name] = float(json.loads(path.read_text())["last_use"])
                except FileNotFoundError:
                    continue  # removed meanwhile
                except (OSError, ValueError, KeyError, TypeError):
                    with contextlib.suppress(OSError):
                        path.unlink()  # unreadable: forget it (the copy is then unprotected)
        return out

    def unused(self, snapshots: Iterable[SnapshotInfo]) -> frozenset[str]:
        """Digests among ``snapshots`` (all of the store's) warmed and not used since."""
        copies = self.recorded()
        snaps = list(snapshots)
        present = {s.digest for s in snaps}
        for gone in copies.keys() - present:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / gone).unlink()
        return frozenset(
            s.digest
            for s in snaps
            if s.digest in copies and not s.leases and s.last_use <= copies[s.digest]
        )
