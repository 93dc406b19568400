"""Process and port helpers shared by every test server launcher in ``preheat.testing``."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers (any HTTP status) or ``timeout`` seconds pass.

    Raises RuntimeError when ``proc`` exits first or time runs out.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answered; a 404 or 503 on the probe URL still means it is up
        except OSError as exc:
            last = exc
            time.sleep(0.05)
    raise RuntimeError(f"server at {url} did not answer within {timeout} s: {last}")


def stop_process(
    proc: subprocess.Popen[bytes], *, grace_s: float = 5.0, sig: int = signal.SIGTERM
) -> None:
    """Send ``sig`` by PID, SIGKILL after ``grace_s``, and reap; safe to call twice."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
