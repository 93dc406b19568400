"""The node agent's watch of its store's ``snapshots/`` directory.

The agent rebuilds its ``NodeCache`` status (and Node labels, and the warm-ups it wants)
from the store at each reconcile, woken by its API watches or every ``--resync``
seconds. A copy can leave the store behind the agent's back: another process pulling
into the same store evicts it, ``preheat cache evict``, a ``verify`` that removed a bad
copy. Without a look at the disk the status went on listing such a copy (Ready, its
Node label, its bytes) until the next resync.

:class:`SnapshotWatch` is that look: the set of entry names in ``snapshots/`` (one
``os.listdir`` per poll, every :data:`POLL_S` seconds while the loop waits), compared
with the entries as the last reconcile began (``record``). A change wakes the loop, and
so does the poll after it: a snapshot directory is renamed away (eviction) or into place
(a fill's publish) inside the store's write transaction, just before its commit, so the
pass woken by the rename may still read the old rows; the second pass reads the
committed ones.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["POLL_S", "SnapshotWatch"]

#: Seconds between two looks at ``snapshots/`` while the agent's loop waits.
POLL_S = 0.5


class SnapshotWatch:
    """Says whether the entries of ``snapshots`` changed since the last look."""

    def __init__(self, snapshots: Path) -> None:
        self.snapshots = snapshots
        self._names: frozenset[str] | None = None
        self._again = False

    def _list(self) -> frozenset[str]:
        try:
            return frozenset(os.listdir(self.snapshots))
        except OSError:  # not there (yet): the store creates it; nothing held
            return frozenset()

    def record(self) -> None:
        """Note the entries now: the agent calls it as each reconcile starts, so a look
        compares with what that pass read (a copy published after the last look and
        evicted before the next would otherwise be no change, and a status that listed
        it would stay). Blocking (one ``listdir``)."""
        self._names = self._list()

    def changed(self) -> bool:
        """True when the entries differ from the last look's (or ``record``'s), and once
        more at the look after that (module docstring); the first look only records them.
        Blocking (one ``listdir``): call it from a worker thread."""
        names = self._list()
        before, self._names = self._names, names
        if before is not None and names != before:
            self._again = True
            return True
        again, self._again = self._again, False
        return again
