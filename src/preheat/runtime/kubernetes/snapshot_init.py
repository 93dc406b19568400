"""``preheat snapshot-init``: the engine pod's init container.

Warm node: the node store (mounted read-only) holds the snapshot, so ``--out`` becomes a
symlink to it (no byte is fetched; the node agent leases the snapshot for the pod through
its ``preheat.dev/snapshot`` annotation). Cold node: the revision is pulled from the
origin into a store beside ``--out`` in the pod's own ``emptyDir`` and ``--out`` links to
that snapshot: a slower start, not a failed pod. Either way the engine reads ``--out``.
The store is only looked at (a directory per manifest digest), never opened for writing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from preheat.store import NodeStore
from preheat.store.layout import Layout

__all__ = ["SnapshotInit", "prepare_snapshot"]


@dataclass(frozen=True)
class SnapshotInit:
    out: Path
    snapshot: Path
    warm: bool
    bytes_fetched: int

    def to_dict(self) -> dict[str, object]:
        return {
            "out": str(self.out),
            "snapshot": str(self.snapshot),
            "warm": self.warm,
            "bytes_fetched": self.bytes_fetched,
        }


def _link(out: Path, target: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, out)


def prepare_snapshot(
    *, store: Path, source: str, revision: str, digest: str | None, out: Path
) -> SnapshotInit:
    """Link ``out`` to the node's snapshot, or pull it into the pod (see module doc)."""
    if digest:
        node_snapshot = Layout(store).snapshot(digest.removeprefix("sha256:"))
        if node_snapshot.is_dir():
            _link(out, node_snapshot)
            return SnapshotInit(out, node_snapshot, True, 0)
    local = NodeStore(out.parent / "store")
    result = local.pull(source, revision=revision)
    _link(out, result.snapshot)
    return SnapshotInit(out, result.snapshot, False, result.bytes_fetched)


def dumps(result: SnapshotInit) -> str:
    return json.dumps(result.to_dict())
