"""One way to launch a child: start, wait for HTTP, stop, and die with the parent."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from preheat.runtime.procs import start_process, wait_http
from preheat.testing.procs import lost_port_race, start_server


def _serve_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie (exited, not yet reaped by init) counts as gone.
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_lost_port_race_is_retried_on_a_new_port(tmp_path: Path) -> None:
    """A server whose port was taken exits; start_server tries again on a free port."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    calls: list[int] = []

    def argv(p: int) -> list[str]:
        calls.append(p)
        return _serve_argv(taken if len(calls) == 1 else p)

    try:
        proc, port = start_server(argv, health="/", log=lambda p: tmp_path / f"s-{p}.log")
    finally:
        held.close()
    try:
        assert len(calls) == 2
        assert port == calls[1] != taken
        assert wait_http(f"http://127.0.0.1:{port}/", timeout=5)
    finally:
        proc.stop()
    assert not proc.running


def test_a_server_that_dies_is_reported_with_its_log(tmp_path: Path) -> None:
    """A command that exits at once raises at once, naming the exit code and its output."""
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited with code 3:\n.*no model here"):
        start_server(lambda p: argv, log=tmp_path / "x.log", timeout=30)
    assert time.monotonic() - t0 < 20
    proc = start_process(argv, tmp_path / "y.log")
    assert proc.wait(10) == 3
    assert not lost_port_race(proc)


def test_sync_wait_works_inside_a_running_event_loop(tmp_path: Path) -> None:
    """A synchronous launcher called from async code (a coroutine test) still waits."""
    proc, port = start_server(_serve_argv, health="/", log=tmp_path / "s.log")

    async def main() -> bool:
        return wait_http(f"http://127.0.0.1:{port}/", timeout=5, accept=lambda s: s == 200)

    try:
        assert asyncio.run(main())
    finally:
        proc.stop()


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    """A process that ignores SIGTERM is killed after the grace period."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = start_process([sys.executable, "-c", code], tmp_path / "t.log")
    deadline = time.monotonic() + 20
    while "up" not in proc.tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.stop(0.5) == -signal.SIGKILL
    assert proc.stop() == -signal.SIGKILL  # twice is fine


@pytest.mark.parametrize("launcher", ["start_fast_backend", "nginx_origin"])
def test_test_servers_die_with_the_process_that_started_them(tmp_path: Path, launcher: str) -> None:
    """SIGKILL of a test process leaves no server behind (the parent-death launcher)."""
    start = {
        "start_fast_backend": "from preheat.testing.routers import start_fast_backend as s; cm = s()",
        "nginx_origin": f"from preheat.testing.origins import nginx_origin as s; cm = s(__import__('pathlib').Path({str(tmp_path)!r}))",
    }[launcher]
    code = textwrap.dedent(
        f"""
        import sys, time
        {start}
        srv = cm.__enter__()
        print(srv.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), line
        child = int(line)
        assert not _gone(child, 0.2)
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
    if not _gone(child, 10):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"server {child} outlived its parent")
