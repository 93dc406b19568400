"""Concurrent pulls into a nearly full store never delete each other's fresh blobs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preheat.errors import InsufficientSpace
from preheat.store import NodeStore

MiB = 1 << 20
PREHEAT = str(Path(sys.executable).with_name("preheat"))
SMALL = ("--capacity", "58MiB", "--high-watermark", "1.0")


def _model(d: Path, sizes: dict[str, int], seed: int) -> Path:
    d.mkdir(parents=True)
    for i, (name, size) in enumerate(sizes.items()):
        (d / name).write_bytes(os.urandom(16) * (size // 16) if size >= 16 else b"x" * size)
        with open(d / name, "r+b") as f:  # make every file distinct
            f.write(f"{seed}-{i}".encode())
    return d


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path]:
    """X: 4 MiB + 28 MiB (the small file lands first); Y: one 24 MiB file."""
    x = _model(tmp_path / "x", {"a.bin": 4 * MiB, "b.bin": 28 * MiB}, seed=1)
    y = _model(tmp_path / "y", {"c.bin": 24 * MiB}, seed=2)
    return x, y


def _blob_of_size(store: Path, size: int) -> bool:
    return any(p.stat().st_size == size for p in store.glob("blobs/sha256/??/*"))


async def _x_then_y(store: NodeStore, x: Path, y: Path) -> tuple[object, object]:
    task = asyncio.create_task(
        store.apull(f"file://{x}", rate_limit=12 * MiB, chunk=1 * MiB, connections=4)
    )
    deadline = time.monotonic() + 30
    while not _blob_of_size(store.root, 4 * MiB):  # X published a.bin, still filling b.bin
        assert time.monotonic() < deadline and not task.done(), "X never got going"
        await asyncio.sleep(0.01)
    try:
        got_y: object = await store.apull(f"file://{y}")
    except InsufficientSpace as exc:
        got_y = exc
    got_x: object
    try:
        got_x = await task
    except Exception as exc:  # the defect: X dies in os.link
        got_x = exc
    return got_x, got_y


def test_pull_during_a_fill_does_not_evict_its_fresh_blobs(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    """X (filling) and Y (needs room) in one process: both succeed when both fit."""
    x, y = models
    store = NodeStore(tmp_path / "store", capacity=58 * MiB, high_watermark=1.0, fsync=False)
    got_x, got_y = asyncio.run(_x_then_y(store, x, y))
    assert not isinstance(got_x, BaseException), repr(got_x)
    assert not isinstance(got_y, BaseException), repr(got_y)
    assert len(store.snapshots()) == 2 and store.verify().ok
    assert store.usage().reserved == 0


def test_pull_that_cannot_fit_beside_a_fill_is_refused_up_front(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    """When X and Y cannot both fit, Y is refused with the numbers and X still succeeds."""
    x, y = models
    store = NodeStore(tmp_path / "store", capacity=50 * MiB, high_watermark=1.0, fsync=False)
    got_x, got_y = asyncio.run(_x_then_y(store, x, y))
    assert not isinstance(got_x, BaseException), repr(got_x)
    assert isinstance(got_y, InsufficientSpace)
    assert got_y.need == 24 * MiB and got_y.evictable == 0 and "reserved by fills" in str(got_y)
    assert [s.refs for s in store.snapshots()] == [(f"file://{x}",)]
    assert not any(store.layout.tmp.glob("*.part"))


def _pull(src: Path, store: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            PREHEAT,
            "cache",
            "pull",
            f"file://{src}",
            "--store",
            str(store),
            "--json",
            *SMALL,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_into_a_nearly_full_store(tmp_path: Path, models: tuple[Path, Path]) -> None:
    """Two `preheat cache pull` processes, X filling and Y needing room: both succeed."""
    x, y = models
    store = tmp_path / "store"
    px = _pull(x, store, "--rate-limit", "12MiB", "--chunk-size", "1MiB", "--connections", "4")
    try:
        deadline = time.monotonic() + 30
        while not _blob_of_size(store, 4 * MiB):
            assert time.monotonic() < deadline and px.poll() is None, "X never got going"
            time.sleep(0.01)
        py = _pull(y, store)
        out_y, err_y = py.communicate(timeout=60)
        out_x, err_x = px.communicate(timeout=60)
    finally:
        for p in (px,):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert px.returncode == 0, err_x
    assert py.returncode == 0, err_y
    digests = {json.loads(out_x)["manifest_digest"], json.loads(out_y)["manifest_digest"]}
    s = NodeStore(store)
    assert {i.digest for i in s.snapshots()} == digests and s.verify().ok
    assert s.usage().reserved == 0


def _child_pid(parent: int) -> int:
    children = Path(f"/proc/{parent}/task/{parent}/children")
    deadline = time.monotonic() + 10
    while not children.read_text().split():
        assert time.monotonic() < deadline, "unshare never started its child"
        time.sleep(0.01)
    return int(children.read_text().split()[0])


def test_reservation_of_a_killed_puller_in_another_pid_namespace_is_released(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    """A puller in its own PID namespace (pid 1 there) is SIGKILLed: its reservation goes."""
    x, y = models
    store = tmp_path / "store"
    cmd = [PREHEAT, "cache", "pull", f"file://{x}", "--store", str(store), "--rate-limit", "4MiB"]
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", *cmd],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        child = _child_pid(proc.pid)
        deadline = time.monotonic() + 30
        while NodeStore(store).usage().reserved == 0:
            assert time.monotonic() < deadline and proc.poll() is None, "pull never reserved"
            time.sleep(0.02)
        os.kill(child, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    s = NodeStore(store, capacity=40 * MiB, high_watermark=1.0, fsync=False)
    assert s.usage().reserved >= 28 * MiB  # the dead puller's row is still there ...
    r = s.pull(f"file://{y}")  # ... and is released because nobody holds its lock
    assert r.bytes_fetched == 24 * MiB and s.usage().reserved == 0
