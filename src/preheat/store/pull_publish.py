"""A pull's last steps on disk: the snapshot directory linked from its blobs and renamed
into place, the ref's audit trail under ``refs/``, and the fault suite's pause hook.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid

from preheat.artifacts.manifest import Manifest
from preheat.artifacts.refs import ArtifactRef
from preheat.sources.base import Resolution
from preheat.store.fill import fsync_dirs
from preheat.store.layout import Layout
from preheat.store.repair import relink

__all__ = ["PAUSE_ENV", "pause", "publish_snapshot", "record_ref"]

PAUSE_ENV = "PREHEAT_TEST_PAUSE_AT"


def pause(phase: str) -> None:
    """Test hook for the fault suite: with ``PREHEAT_TEST_PAUSE_AT=<phase>`` in the
    environment the pull says ``paused at <phase>`` on stderr and sleeps 60 s there, so a
    test can SIGKILL it in exactly that phase. Phases: ``download`` (first blob published,
    others in flight), ``verify`` (every blob verified, no snapshot yet), ``publish``
    (snapshot linked in tmp/, not renamed), ``commit`` (snapshot visible, no DB row)."""
    if os.environ.get(PAUSE_ENV) == phase:
        print(f"paused at {phase}", file=sys.stderr, flush=True)
        time.sleep(60)


def publish_snapshot(layout: Layout, manifest: Manifest, digest: str, *, fsync: bool) -> None:
    """Link snapshot ``digest`` of ``manifest`` from its blobs and rename it into place."""
    final = layout.snapshot(digest)
    if final.is_dir():
        # already there; re-link any path that no longer is its blob (a snapshot kept
        # for its leases after verify quarantined a blob it could not repair)
        for d in {f.sha256 for f in manifest.files if f.sha256 is not None}:
            relink(layout, digest, manifest, d)
        return
    work = layout.tmp / f"snap-{digest[:16]}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        for f in manifest.files:
            assert f.sha256 is not None
            dest = layout.inside(work, f.path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.link(layout.blob(f.sha256), dest)
        pause("publish")
        try:
            os.rename(work, final)
        except OSError:
            if not final.is_dir():
                raise
        if fsync:
            fsync_dirs({layout.snapshots, final})
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def record_ref(layout: Layout, ref: ArtifactRef, res: Resolution, digest: str) -> None:
    """Write what ``ref`` resolved to under ``refs/`` (``latest`` and ``history.jsonl``)."""
    d = layout.refs / ref.key
    d.mkdir(parents=True, exist_ok=True)
    entry = {
        "ref": ref.display,  # an audit trail people read: no credentials
        "revision": res.revision,
        "label": res.label,
        "manifest_digest": digest,
        "resolved": time.time(),
    }
    line = json.dumps(entry)
    tmp = d / f".latest.{os.getpid()}.{uuid.uuid4().hex[:6]}"
    tmp.write_text(line + "\n")
    os.replace(tmp, d / "latest")
    with open(d / "history.jsonl", "a") as f:
        f.write(line + "\n")
