"""The node agent's pod leases: the pods bound to its node (fed by the pod watch) and the
store leases they hold. A pod whose ``preheat.dev/snapshot`` annotation names a held
snapshot leases it (holder ``pod:<namespace>/<name>:<uid>``) until the pod is gone or
finished; nothing is released on a partial view (before the first list)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from preheat.runtime.kubernetes.nodecache_status import SNAPSHOT_ANNOTATION
from preheat.store import NodeStore

__all__ = ["POD_HOLDER", "PodLeases"]

log = logging.getLogger("preheat.agent")
POD_HOLDER = "pod:"


class PodLeases:
    """The watched pods (written by the watch thread under ``lock``) and their leases."""

    def __init__(self, store: NodeStore) -> None:
        self.store = store
        self.pods: dict[str, tuple[str, str | None, bool]] = {}  # holder -> (name, snap, done)
        self.synced = False
        self.lock = threading.Lock()

    def apply(self, kind: str | None, objs: list[Any]) -> None:
        """A watch event (``kind`` None: a full list) for pod objects."""
        with self.lock:
            if kind is None:
                self.pods = {}
                self.synced = True
            for p in objs:
                m = p.metadata
                holder = f"{POD_HOLDER}{m.namespace}/{m.name}:{m.uid}"
                finished = (p.status.phase if p.status else None) in ("Succeeded", "Failed")
                if kind == "DELETED":
                    self.pods.pop(holder, None)
                else:
                    snap = (m.annotations or {}).get(SNAPSHOT_ANNOTATION)
                    self.pods[holder] = (m.name, snap, finished)

    def reconcile(self, held_snapshot: Callable[[str], bool]) -> None:
        """Lease what running pods use (``held_snapshot(key)``: the store holds it); release
        the leases of pods gone, finished or without the annotation."""
        with self.lock:
            if not self.synced:
                return  # never release on a partial view
            pods = dict(self.pods)
        held: dict[str, set[str]] = {}
        for info in self.store.snapshots():
            for h in info.leases:
                held.setdefault(h, set()).add(info.digest)
        for holder, (_name, snap, finished) in pods.items():
            if snap and not finished and holder not in held and held_snapshot(snap):
                self.store.lease(snap, holder)
                log.info("leased %s for %s", snap, holder)
        for holder in held:
            if holder.startswith(POD_HOLDER) and (
                holder not in pods or pods[holder][2] or not pods[holder][1]
            ):
                self.store.release_holder(holder)
                log.info("released the lease of %s", holder)

    def count(self) -> int:
        """Pod leases the store holds now."""
        return sum(1 for i in self.store.snapshots() for h in i.leases if h.startswith(POD_HOLDER))
