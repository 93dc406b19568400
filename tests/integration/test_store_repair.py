"""verify and lease repair what a replica uses instead of dropping it (real nginx, files)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from preheat.bench.models import generate_model, write_http_manifest
from preheat.errors import CacheError
from preheat.store import NodeStore
from preheat.testing.origins import nginx_origin

MiB = 1 << 20
PREHEAT = str(Path(sys.executable).with_name("preheat"))


def _tree(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != "preheat-manifest.json"
    }


def _flip(path: Path, at: int = 100) -> None:
    """Change one byte in place, as root would (0444 does not stop root)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    generate_model(root / "m", 4 * MiB, 2, seed=11)
    write_http_manifest(root / "m")
    return root


def test_verify_refetches_a_corrupt_blob_of_a_leased_snapshot(tmp_path: Path, origin: Path) -> None:
    """A corrupt blob under a lease is fetched again from the origin; the lease stays."""
    store = NodeStore(tmp_path / "store", fsync=False)
    with nginx_origin(origin) as o:
        r = store.pull(o.url("m/preheat-manifest.json"))
        store.lease(r.manifest_digest, "replica-1")
        blob = max(store.layout.blobs.glob("??/*"), key=lambda p: p.stat().st_size)
        _flip(blob)
        rep = store.verify()
    assert not rep.ok and rep.corrupt[0][0] == blob.name  # it was corrupt ...
    (fix,) = rep.repairs
    assert fix.repaired and fix.holders == ("replica-1",) and fix.snapshots == (r.manifest_digest,)
    assert rep.removed_snapshots == ()  # ... and nothing a replica uses was dropped
    assert store.leases(r.manifest_digest) == ["replica-1"]
    assert _tree(r.snapshot) == _tree(origin / "m") and store.verify().ok
    assert list(store.layout.quarantine.iterdir())  # the bad bytes are kept for a post-mortem


def test_verify_keeps_a_leased_snapshot_it_cannot_repair(tmp_path: Path, origin: Path) -> None:
    """Origin gone: the leased snapshot and its lease stay (reported), an unleased one goes,
    and the next pull from a live origin re-links the kept snapshot."""
    store = NodeStore(tmp_path / "store", fsync=False)
    shutil.copytree(origin / "m", tmp_path / "copy")
    with nginx_origin(origin) as o:
        leased = store.pull(o.url("m/preheat-manifest.json"))
        url = o.url("m/preheat-manifest.json")
    store.lease(leased.manifest_digest, "replica-2")
    blob = max(store.layout.blobs.glob("??/*"), key=lambda p: p.stat().st_size)
    _flip(blob)
    rep = store.verify()  # nginx is stopped: nothing answers
    (fix,) = rep.unrepaired
    assert fix.holders == ("replica-2",) and "127.0.0.1" in fix.reason
    assert store.leases(leased.manifest_digest) == ["replica-2"]
    assert rep.removed_snapshots == ()
    with nginx_origin(tmp_path / "copy", port=int(url.split(":")[2].split("/")[0])) as o2:
        again = store.pull(o2.url("preheat-manifest.json"))
    assert again.manifest_digest == leased.manifest_digest and again.bytes_fetched > 0
    assert _tree(leased.snapshot) == _tree(origin / "m") and store.verify().ok


def test_lease_repairs_a_blob_a_replica_wrote_into(tmp_path: Path, origin: Path) -> None:
    """A replica (root) writes into its snapshot; the next lease re-fetches the blob."""
    store = NodeStore(tmp_path / "store", fsync=False)
    with nginx_origin(origin) as o:
        r = store.pull(o.url("m/preheat-manifest.json"))
        store.lease(r.manifest_digest, "replica-a")
        victim = sorted(r.snapshot.glob("*.safetensors"))[0]
        _flip(victim, at=2048)  # through the hard link: the shared blob changes
        assert _tree(r.snapshot) != _tree(origin / "m")
        store.lease(r.manifest_digest, "replica-b")
    assert _tree(r.snapshot) == _tree(origin / "m")
    assert store.leases(r.manifest_digest) == ["replica-a", "replica-b"]


def test_lease_refuses_a_poisoned_snapshot_it_cannot_repair(tmp_path: Path, origin: Path) -> None:
    """Changed bytes and no origin: the lease is refused, naming the blob."""
    store = NodeStore(tmp_path / "store", fsync=False)
    with nginx_origin(origin) as o:
        r = store.pull(o.url("m/preheat-manifest.json"))
    victim = sorted(r.snapshot.glob("*.safetensors"))[0]
    _flip(victim, at=2048)
    with pytest.raises(CacheError, match="changed on disk"):
        store.lease(r.manifest_digest, "replica-c")
    assert store.leases(r.manifest_digest) == []


def test_cli_verify_shows_repair_and_holders(tmp_path: Path, origin: Path) -> None:
    """`preheat cache verify` names the repaired blob, its origin and the lease holders."""
    store = tmp_path / "store"
    with nginx_origin(origin) as o:
        out = subprocess.run(
            [
                PREHEAT,
                "cache",
                "pull",
                o.url("m/preheat-manifest.json"),
                "--store",
                str(store),
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        digest = json.loads(out)["manifest_digest"]
        NodeStore(store).lease(digest, "replica-7")
        blob = max(store.glob("blobs/sha256/??/*"), key=lambda q: q.stat().st_size)
        _flip(blob)
        p = subprocess.run(
            [PREHEAT, "cache", "verify", "--store", str(store)], capture_output=True, text=True
        )
    assert p.returncode == 1, p.stderr
    assert f"CORRUPT blob {blob.name}" in p.stdout
    assert f"repaired blob {blob.name}" in p.stdout and "replica-7" in p.stdout
    assert NodeStore(store).verify().ok
