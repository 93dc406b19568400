"""`preheat up | status | scale | apply | node | down` as a user runs them: real processes,
a control API on 127.0.0.1, and a clean stop that leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.testing.fleet import make_model

pytestmark = pytest.mark.timeout(120)

PREHEAT = [sys.executable, "-c", "from preheat.cli import main; main()"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PREHEAT, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers kill(0); count it as gone.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False
    return True


def write_spec(path: Path, source: str, *, extra: str = "") -> None:
    path.write_text(
        f"""
name: chat
model: {{source: "{source}"}}
engine: {{simulated: {{profile: tiny, time_scale: 0.01}}}}
replicas: {{min: 1, max: 2}}
modelCacheConfig:
  weights: {{enabled: true}}
{extra}
"""
    )


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    model = make_model(tmp_path / "origin" / "m1", size=2_000_000, shards=2, seed=7)
    write_spec(tmp_path / "endpoint.yaml", model.ref)
    (tmp_path / "cluster.yaml").write_text(
        "nodes:\n  - {name: a, capacity: 1GiB, slots: 2}\n  - {name: b, capacity: 1GiB}\n"
    )
    return tmp_path


@contextlib.contextmanager
def fleet_up(workdir: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [*PREHEAT, "up", "-f", "endpoint.yaml", "--cluster", "cluster.yaml", "--no-live"],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def wait_status(workdir: Path, predicate, timeout: float = 60) -> dict:  # type: ignore[no-untyped-def,type-arg]
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        r = run("status", "--json", cwd=workdir)
        if r.returncode == 0:
            last = json.loads(r.stdout)
            if predicate(last):
                return last  # type: ignore[return-value]
        else:
            last = r.stderr
        time.sleep(0.2)
    raise AssertionError(f"status never matched: {last}")


def replica_pids(workdir: Path) -> list[int]:
    """PIDs of the engines from their own /startup answers, via the status URLs."""
    import urllib.request

    st = json.loads(run("status", "--json", cwd=workdir).stdout)
    pids = []
    for r in st["replicas"]:
        with urllib.request.urlopen(r["url"] + "/startup", timeout=5) as resp:
            pids.append(int(json.loads(resp.read())["pid"]))
    return pids


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("PPid:"):
                    if int(line.split()[1]) == pid:
                        out.append(int(entry.name))
                    break
    return out


def test_invalid_spec_names_field_and_starts_nothing(tmp_path: Path) -> None:
    """`preheat up` with a bad spec exits 2 with the field named; no state, no process."""
    (tmp_path / "bad.yaml").write_text(
        "name: chat\nmodel: {source: 'file:///x'}\nrouting: {prefix_length: 100}\n"
    )
    r = run("up", "-f", "bad.yaml", cwd=tmp_path)
    assert r.returncode == 2
    assert "endpoint 'chat': routing.prefix_length 100 is below 1024" in r.stderr
    assert not (tmp_path / ".preheat").exists()


def test_up_steer_and_down(workdir: Path) -> None:
    """A whole session: up, status, a rejected apply, scale, node fail, down; afterwards
    no replica process is left."""
    with fleet_up(workdir) as proc:
        st = wait_status(workdir, lambda s: s["variants"][0]["ready"] == 1)
        rev = st["variants"][0]["revision"]
        first = [r["id"] for r in st["replicas"]]

        # An invalid change is rejected and changes nothing.
        write_spec(workdir / "bad.yaml", "file:///nowhere", extra="routing: {strategy: fastest}")
        r = run("apply", "-f", "bad.yaml", cwd=workdir)
        assert r.returncode == 2 and "routing.strategy 'fastest' is unknown" in r.stderr
        st = json.loads(run("status", "--json", cwd=workdir).stdout)
        assert [x["id"] for x in st["replicas"]] == first
        assert st["variants"][0]["revision"] == rev

        r = run("scale", "2", cwd=workdir)
        assert r.returncode == 0, r.stderr
        r = run("scale", "7", cwd=workdir)
        assert r.returncode == 2 and "allows 1..2 replicas, not 7" in r.stderr
        st = wait_status(workdir, lambda s: s["variants"][0]["ready"] == 2)

        r = run("node", "fail", "b", cwd=workdir)
        assert r.returncode == 0, r.stderr
        st = wait_status(
            workdir,
            lambda s: (
                s["variants"][0]["ready"] == 2 and all(x["node"] == "a" for x in s["replicas"])
            ),
        )
        r = run("node", "fail", "zz", cwd=workdir)
        assert r.returncode == 1 and "no node 'zz'" in r.stderr

        text = run("status", cwd=workdir)
        assert text.returncode == 0 and "replicas" in text.stdout and "nodes" in text.stdout

        import urllib.request

        control = json.loads((workdir / ".preheat" / "control.json").read_text())
        with urllib.request.urlopen(control["url"] + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert 'preheat_starts_total{event_class="node_loss_recovery",outcome="ok"}' in metrics
        assert 'preheat_node_revision_ready{node="a"' in metrics

        pids = replica_pids(workdir)
        assert len(pids) == 2
        r = run("down", cwd=workdir)
        assert r.returncode == 0, r.stderr
        proc.wait(timeout=30)
        assert proc.returncode == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
        assert not (workdir / ".preheat" / "control.json").exists()
        assert run("status", cwd=workdir).returncode == 1


def test_ctrl_c_stops_every_process(workdir: Path) -> None:
    """SIGINT to `preheat up` stops the replicas and the router, then exits cleanly."""
    with fleet_up(workdir) as proc:
        wait_status(workdir, lambda s: s["variants"][0]["ready"] == 1)
        pids = replica_pids(workdir)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "stopped every process" in out
        assert not any(alive(p) for p in pids)


def test_status_shows_cache_inventory(workdir: Path) -> None:
    """`preheat status` prints each node's cache inventory as a table, and `--json` holds
    it: revisions, bytes, last use, leases, pin, priority, free space, eviction order, and
    the last warm-up failure with its reason (a node too small for the model)."""
    (workdir / "cluster.yaml").write_text(
        "nodes:\n  - {name: a, capacity: 1GiB, slots: 2}\n  - {name: tiny, capacity: 1MB}\n"
    )
    spec = (workdir / "endpoint.yaml").read_text()
    spec = spec.replace(
        "weights: {enabled: true}", "weights: {enabled: true, pin: true, priority: 7}"
    )
    (workdir / "endpoint.yaml").write_text(spec)
    with fleet_up(workdir):
        st = wait_status(workdir, lambda s: s["variants"][0]["ready"] == 1)
        rev = st["variants"][0]["revision"]
        (replica,) = st["replicas"]
        inv = {n["node"]: n for n in st["inventory"]}
        assert set(inv) == {"a", "tiny"}
        (snap,) = inv["a"]["snapshots"]
        assert snap["revision"] == rev
        assert snap["size_bytes"] == st["variants"][0]["model_bytes"]
        assert snap["leased_by"] == [replica["id"]]
        assert snap["pinned"] is True and snap["priority"] == 7
        assert snap["last_use"] is not None and snap["ready"] is True
        assert inv["a"]["free_bytes"] > 0 and inv["a"]["capacity_bytes"] == 1024**3
        assert inv["a"]["eviction_candidates"] == []  # leased and pinned: never evicted
        assert inv["a"]["last_warmup_failure"] is None
        fail = inv["tiny"]["last_warmup_failure"]
        assert inv["tiny"]["snapshots"] == [] and fail["revision"] == rev
        assert fail["reason"]  # the numbers: what it needs vs what it has

        r = subprocess.run(
            [*PREHEAT, "status"],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "250"},
        )
        assert r.returncode == 0, r.stderr
        text = r.stdout
        assert "Cache inventory" in text
        for column in ("revision", "size", "last use", "leased by", "pinned", "prio", "evict #"):
            assert column in text
        assert replica["id"] in text and rev in text
        assert "free" in text and f"warm-up of {rev} failed" in text


def test_sigkill_of_up_leaves_no_child(workdir: Path) -> None:
    """When `preheat up` is killed outright (no chance to clean up), the router and the
    replicas it started die with it (parent-death signal), within a few seconds."""
    with fleet_up(workdir) as proc:
        wait_status(workdir, lambda s: s["variants"][0]["ready"] == 1)
        engines = replica_pids(workdir)
        children = children_of(proc.pid)
        try:
            # The router and the replica, started directly by `up` (the launcher execs).
            assert len(children) >= 2 and set(engines) <= set(children), (children, engines)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            deadline = time.monotonic() + 5
            while any(alive(p) for p in children) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not [p for p in children if alive(p)]
        finally:
            for p in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
