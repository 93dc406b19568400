"""The one way ``preheat.testing`` starts a server process, waits for it and stops it.

Every launcher here (simulated engines, llama-server, preheat and peer routers, the fast
fake backend, nginx, moto's S3) goes through ``start_server``, which is a thin layer over
``preheat.runtime.procs``: the same launcher (own session, SIGTERM when this process
dies), the same ``free_port``, the same HTTP wait loop (``wait_http_ok``, run on a private
event loop for these synchronous callers) and the same stop (signal by PID, SIGKILL
after a grace period)::

    proc, port = start_server(lambda p: [..., "--port", str(p)], log=tmp / "x.log")
    ...
    proc.stop()

With no port given, a free one is picked, and a start that lost its port to another
process ("address already in use" in its log) is retried on a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from preheat.runtime.procs import ANY_STATUS, Process, free_port, start_process, wait_http

__all__ = [
    "ANY_STATUS",
    "Process",
    "free_port",
    "lost_port_race",
    "start_server",
    "wait_up",
]

#: Log text of a server that could not bind its port (Python, nginx, llama.cpp, Rust).
_BIND_ERRORS = ("address already in use", "could not bind", "couldn't bind", "bind()")


def lost_port_race(proc: Process) -> bool:
    """Whether ``proc`` exited because its port was taken (from its log)."""
    if proc.running or proc.log is None:
        return False
    try:
        text = proc.log.read_text(errors="replace").lower()
    except OSError:
        return False
    return any(e in text for e in _BIND_ERRORS)


def wait_up(
    proc: Process,
    url: str,
    *,
    timeout: float,
    accept: Callable[[int], bool] = ANY_STATUS,
    error: type[Exception] = RuntimeError,
    what: str = "server",
) -> None:
    """Block until ``url`` answers with a status ``accept`` takes; raise ``error`` (with
    the log's tail) when the process exits first or ``timeout`` seconds pass."""
    if wait_http(url, timeout=timeout, child=proc, accept=accept):
        return
    if not proc.running:
        why = f"exited with code {proc.returncode}"
    else:
        why = f"did not answer within {timeout:.0f} s"
    raise error(f"{what} at {url} (pid {proc.pid}) {why}:\n{proc.tail(20)}")


def start_server(
    argv_for: Callable[[int], list[str]],
    *,
    port: int | None = None,
    health: str = "/health",
    log: Path | Callable[[int], Path] | None = None,
    env: Mapping[str, str] | None = None,
    inherit_env: bool = True,
    stdin_pipe: bool = False,
    timeout: float = 30.0,
    accept: Callable[[int], bool] = ANY_STATUS,
    error: type[Exception] = RuntimeError,
    what: str = "server",
    wait: bool = True,
    attempts: int = 3,
) -> tuple[Process, int]:
    """Start ``argv_for(port)`` and (with ``wait``) block until ``health`` answers.

    ``log`` may depend on the port (``lambda p: dir / f"x-{p}.log"``). On failure the
    process is stopped and ``error`` raised with its log's tail; with no ``port`` given a
    lost port race is retried on a new port (up to ``attempts``). The caller stops the
    returned process (``Process.stop``).
    """
    for attempt in range(attempts):
        p = port or free_port()
        proc = start_process(
            argv_for(p),
            log(p) if callable(log) else log,
            env=env,
            inherit_env=inherit_env,
            stdin_pipe=stdin_pipe,
        )
        if not wait:
            return proc, p
        try:
            wait_up(
                proc,
                f"http://127.0.0.1:{p}{health}",
                timeout=timeout,
                accept=accept,
                error=error,
                what=what,
            )
            return proc, p
        except BaseException as exc:
            proc.stop(5)
            if (
                not isinstance(exc, error)
                or port is not None
                or attempt == attempts - 1
                or not lost_port_race(proc)
            ):
                raise
    raise AssertionError("unreachable")
