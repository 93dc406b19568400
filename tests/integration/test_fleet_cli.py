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
