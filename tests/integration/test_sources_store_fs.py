"""The store's filesystem: full mid-fill on every write path, or not the source's.

The store lives on a small tmpfs mounted by the test (as root). Once the fill has begun
(its first progress report), a ballast file takes nearly every free byte, so a write of
the fill hits ENOSPC (a little is left, so that sqlite can still commit): through ``os.pwrite`` (aiohttp and plain-read paths), ``splice(2)``
(the zero-copy HTTP path) or ``copy_file_range(2)`` (file://). The pull must fail with
``InsufficientSpace`` (not a retried ``OriginUnavailable``, not a bare ``OSError``),
publish nothing, hold no reservation, and succeed once the space is back. A file://
source on another filesystem than the store is copied too.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preheat.errors import InsufficientSpace
from preheat.store import NodeStore
from preheat.testing.origins import nginx_origin

MiB = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


class FillDisk:
    """A progress callback that, on the fill's first report, fills the store's filesystem
    up to ``spare`` bytes (room for sqlite's journal, far less than the fill needs)."""

    def __init__(self, where: Path, spare: int = 2 * MiB) -> None:
        self.ballast = where / "ballast"
        self.spare = spare
        self.fired = False

    def __call__(self, done: int, total: int) -> None:
        if self.fired:
            return
        self.fired = True
        st = os.statvfs(self.ballast.parent)
        left = st.f_bavail * st.f_frsize - self.spare
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while left > 0:
                left -= os.write(fd, b"\0" * min(left, MiB))
        finally:
            os.close(fd)


@pytest.mark.parametrize("path", ["splice", "aiohttp", "file-direct", "file-read"])
def test_disk_full_mid_fill_is_insufficient_space(
    tmp_path: Path, small_fs: Path, path: str
) -> None:
    """ENOSPC while writing a blob is InsufficientSpace naming the file and the free
    space; nothing is published, no reservation or partial is left, and the same pull
    succeeds after the space is freed."""
    root = tmp_path / "origin"
    root.mkdir()
    data = hashlib.sha256(b"full").digest() * (12 * MiB // 32)
    (root / "w.bin").write_bytes(data)
    store = NodeStore(small_fs / "store", retries=2, backoff=0.01)
    fill = FillDisk(small_fs)
    kw: dict[str, Any] = {"chunk": 1 * MiB, "connections": 2}
    if path in ("aiohttp", "file-read"):
        kw["rate_limit"] = 1e12  # any limit takes the copying path
    with nginx_origin(root) as o:
        ref = o.url("w.bin") if path in ("splice", "aiohttp") else f"file://{root}"
        with pytest.raises(InsufficientSpace) as err:
            store.pull(ref, progress=fill, **kw)
        assert fill.fired
        msg = str(err.value)
        assert "w.bin" in msg and "disk full" in msg and "free" in msg
        assert list(store.layout.blobs.glob("??/*")) == []
        assert list(store.layout.snapshots.iterdir()) == []
        assert list(store.layout.tmp.glob("*.part")) == []
        assert store.snapshots() == [] and store.usage().reserved == 0
        fill.ballast.unlink()
        r = store.pull(ref, **kw)
    assert (r.snapshot / "w.bin").read_bytes() == data


def test_file_source_on_another_filesystem(tmp_path: Path, small_fs: Path) -> None:
    """A file:// source on another filesystem than the store (copy_file_range answers
    EXDEV there on many kernels) is copied through the plain-read path."""
    root = tmp_path / "origin"
    root.mkdir()
    data = hashlib.sha256(b"exdev").digest() * (3 * MiB // 32)
    (root / "w.bin").write_bytes(data)
    r = NodeStore(small_fs / "store").pull(f"file://{root}", chunk=1 * MiB)
    assert (r.snapshot / "w.bin").read_bytes() == data
    assert r.bytes_fetched == len(data)
