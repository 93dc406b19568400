"""Store fault suite: SIGKILL in each fill phase, a disk that fills up mid-fill, many failures.

The phases are hit deterministically with the test hook ``PREHEAT_TEST_PAUSE_AT=<phase>``
(``preheat.store.pull``): the pull says ``paused at <phase>`` and sleeps there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preheat.bench.models import generate_model, write_http_manifest
from preheat.errors import DigestMismatch
from preheat.store import NodeStore
from preheat.testing.origins import nginx_origin

MiB = 1 << 20
PREHEAT = str(Path(sys.executable).with_name("preheat"))
SLOW = ("--json", "--rate-limit", "8MiB", "--chunk-size", "1MiB")


def _tree(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != "preheat-manifest.json"
    }


def _consistent(store: NodeStore) -> None:
    """Every DB snapshot is a complete directory and every directory has its row."""
    rows = {s.digest for s in store.snapshots()}
    dirs = {p.name for p in store.layout.snapshots.iterdir()}
    assert rows == dirs
    assert store.verify().ok


@pytest.mark.parametrize("phase", ["download", "verify", "publish", "commit"])
def test_sigkill_in_each_fill_phase_then_pull_again(tmp_path: Path, phase: str) -> None:
    """Killed in any phase: the store stays consistent and the next pull completes it."""
    src = tmp_path / "src"
    generate_model(src, 8 * MiB, 4, seed=21)
    store = tmp_path / "store"
    env = dict(os.environ, PREHEAT_TEST_PAUSE_AT=phase)
    proc = subprocess.Popen(
        [PREHEAT, "cache", "pull", f"file://{src}", "--store", str(store), "--json"]
        + (["--rate-limit", "4MiB", "--chunk-size", "1MiB"] if phase == "download" else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.strip() == f"paused at {phase}", line + proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
    s = NodeStore(store, fsync=False)
    if phase == "commit":  # the directory is visible, its row is not: not a snapshot yet
        assert s.snapshots() == [] and len(list(s.layout.snapshots.iterdir())) == 1
    else:
        _consistent(s)
        assert s.snapshots() == []
    r = s.pull(f"file://{src}")
    assert _tree(r.snapshot) == _tree(src)
    total = sum(p.stat().st_size for p in src.iterdir())
    if phase != "download":  # every blob was verified before the kill: nothing moves again
        assert r.bytes_fetched == 0 and r.bytes_reused == total
    _consistent(s)
    assert s.usage().reserved == 0


def test_disk_full_mid_fill_leaves_the_store_consistent(tmp_path: Path) -> None:
    """A tmpfs that another writer fills during the pull: a clear error, nothing published."""
    src = tmp_path / "src"
    generate_model(src, 24 * MiB, 4, seed=22)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], check=True)
    try:
        store_dir = mnt / "store"
        proc = subprocess.Popen(
            [PREHEAT, "cache", "pull", f"file://{src}", "--store", str(store_dir), *SLOW],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not any(store_dir.glob("tmp/*.part")):
            assert time.monotonic() < deadline and proc.poll() is None, "pull never started"
            time.sleep(0.01)
        with open(mnt / "other-tenant.bin", "wb") as f:  # another writer takes the rest
            try:
                while True:
                    f.write(b"\0" * MiB)
            except OSError:
                pass
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, out + err
        assert "InsufficientSpace" in err and "filled up" in err and "consistent" in err
        assert "Traceback" not in err
        (mnt / "other-tenant.bin").unlink()
        s = NodeStore(store_dir, fsync=False)
        _consistent(s)
        assert s.snapshots() == []  # a reservation row the full disk kept has no lock holder
        # room again: it completes, reusing what was verified (through Python reads: this
        # kernel's copy_file_range refuses tmpfs <- disk with EXDEV, see the report)
        r = s.pull(f"file://{src}", rate_limit=1e12)
        assert _tree(r.snapshot) == _tree(src)
        _consistent(s)
        assert s.usage().reserved == 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_every_failed_file_is_reported(tmp_path: Path) -> None:
    """Two files with wrong bytes: one error whose message names both, with both digests."""
    root = tmp_path / "o"
    generate_model(root / "m", 4 * MiB, 4, seed=23)
    write_http_manifest(root / "m")
    shards = sorted((root / "m").glob("*.safetensors"))
    for p in shards[:2]:
        data = bytearray(p.read_bytes())
        data[10] ^= 1
        p.write_bytes(bytes(data))
    store = NodeStore(tmp_path / "store", retries=0, fsync=False)
    with nginx_origin(root) as o, pytest.raises(DigestMismatch) as ei:
        store.pull(o.url("m/preheat-manifest.json"))
    msg = str(ei.value)
    assert "2 files failed" in msg and shards[0].name in msg and shards[1].name in msg
    assert sorted(p for p, _ in ei.value.failures) == sorted(p.name for p in shards[:2])
    _consistent(store)
    shutil.rmtree(root)
