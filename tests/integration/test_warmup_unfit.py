"""A local node's warm-up that its store cannot hold: ``unfit`` for good only when the model
is bigger than what the store can ever hold, its capacity or, when that is smaller, its
disk's total size (x the store's high watermark); retried when it could fit later."""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from preheat.artifacts.manifest import FileEntry, Manifest
from preheat.control.spec import parse_cluster
from preheat.runtime.local import LocalFleet
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.testing.fleet import endpoint_spec, make_model
from preheat.testing.origins import nginx_origin

pytestmark = pytest.mark.timeout(60)

MB = 1_000_000


def _view(fleet: LocalFleet, rev: str) -> dict[str, Any]:
    return dict(fleet.status()["nodes"][0]["cache"].get(rev, {}))


def _manifest_gets(log: Path) -> int:
    text = log.read_text() if log.exists() else ""
    return sum(1 for line in text.splitlines() if line.endswith("/preheat-manifest.json"))


async def test_a_model_bigger_than_the_disk_is_unfit_for_good_under_a_larger_capacity(
    tmp_path: Path,
) -> None:
    """A node whose capacity (4x its disk) is bigger than its disk is bounded by the disk:
    a model its disk can never hold (the manifest says twice the disk) is ``unfit`` after
    one attempt and not tried again (no further manifest request in 3.5 s); the old rule
    looked at the capacity alone and retried it at every backoff (1 s, 2 s, ...) for as
    long as the fleet ran."""
    disk = shutil.disk_usage(tmp_path).total
    huge = tmp_path / "origin" / "huge"
    huge.mkdir(parents=True)
    # Never fetched: the fill's reservation is refused before any byte is asked for.
    entry = FileEntry("model.safetensors", 2 * disk, "ab" * 32)
    (huge / "preheat-manifest.json").write_text(Manifest((entry,)).to_json())
    log = tmp_path / "access.log"
    with nginx_origin(tmp_path / "origin", access_log=log) as origin:
        spec = endpoint_spec(
            "chat", origin.url("huge/preheat-manifest.json"), replicas=0, cache={"enabled": True}
        )
        cluster = parse_cluster(
            {"nodes": [{"name": "n0", "capacity": 4 * disk, "slots": 1}]}, base_dir=tmp_path
        )
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "resolve")
            rev = fleet.status()["variants"][0]["revision"]
            await fleet.wait_until(lambda f: _view(f, rev).get("state") == "unfit", 30, "unfit")
            assert "no capacity set" not in _view(fleet, rev)["reason"]
            gets = _manifest_gets(log)
            await asyncio.sleep(3.5)  # the old rule tried again at +1 s and +3 s
            assert _view(fleet, rev).get("state") == "unfit"
            assert _manifest_gets(log) == gets
            assert sum("n0 cannot hold" in m for m in fleet.status()["messages"]) == 1


async def test_a_disk_bound_warm_up_that_meets_another_fills_reservation_is_retried(
    tmp_path: Path,
) -> None:
    """On a node bounded by its disk (capacity 4x the disk), another process's fill that
    reserves all but 10 MB of the free disk leaves the 100 MB warm-up ``unfit``, retried
    (it fits the disk); once that process is gone (its reservation with it) the warm-up
    fills and the view is ``ready``."""
    model = make_model(tmp_path / "origin" / "m", size=100 * MB, shards=2, seed=41)
    store = tmp_path / "nodes" / "n0"  # parse_cluster: base_dir/nodes/<name>
    disk = shutil.disk_usage(tmp_path).total
    other = _big_file_origin(tmp_path / "big", shutil.disk_usage(tmp_path).free - 10 * MB)
    with nginx_origin(tmp_path / "big") as origin:
        exe = Path(sys.executable).parent / "preheat"
        argv = [str(exe), "cache", "pull", origin.url("x/preheat-manifest.json"),
                "--store", str(store), "--rate-limit", "1MB"]  # fmt: skip
        filler = start_process(argv, tmp_path / "filler.log")
        try:
            probe = NodeStore(store)
            deadline = time.monotonic() + 20
            while probe.usage().reserved < other:
                assert time.monotonic() < deadline, (tmp_path / "filler.log").read_text()
                await asyncio.sleep(0.05)
            spec = endpoint_spec("chat", model.ref, replicas=0, cache={"enabled": True})
            cluster = parse_cluster(
                {"nodes": [{"name": "n0", "capacity": 4 * disk, "slots": 1}]},
                base_dir=tmp_path,
            )
            async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
                await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "rev")
                rev = fleet.status()["variants"][0]["revision"]
                await fleet.wait_until(lambda f: _view(f, rev).get("state") == "unfit", 30, "unfit")
                filler.stop(0.1, sig=signal.SIGKILL)
                await fleet.wait_until(lambda f: _view(f, rev).get("state") == "ready", 30, "ready")
                assert any("n0 cannot hold" in m for m in fleet.status()["messages"])
        finally:
            filler.stop(0.1, sig=signal.SIGKILL)


def _big_file_origin(root: Path, size: int) -> int:
    """A one-file model of ``size`` bytes (a sparse file, a made-up digest: its fill is
    stopped long before it could finish) under ``root/x``; returns ``size``."""
    (root / "x").mkdir(parents=True)
    with open(root / "x" / "big.bin", "wb") as f:
        f.truncate(size)
    entry = FileEntry("big.bin", size, "cd" * 32)
    (root / "x" / "preheat-manifest.json").write_text(Manifest((entry,)).to_json())
    return size
