"""Child processes of the local runtime: start, wait for HTTP health, stop by PID.

Children run in their own session (``start_new_session``) so a Ctrl-C in the terminal
reaches only ``preheat up``, which then stops them in order (router last) instead of
every process dying at once mid-request.

Their own session also means nothing stops them when ``preheat up`` itself is killed
(SIGKILL, OOM killer). On Linux each child therefore asks the kernel for a parent-death
signal: it is started through a tiny launcher (``python -I -S -c LAUNCHER PPID ARGV...``)
that calls ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` and then ``execvp``s the real command
(the setting survives ``execve``). Why a launcher and not ``preexec_fn``: the fleet runs
worker threads (store I/O, hashing) while it spawns, and code between ``fork`` and
``exec`` in a threaded parent may deadlock on a lock another thread held at the fork
(the import lock, malloc); ``preexec_fn`` also forces the slow fork path. The launcher
is a fresh single-threaded process, so it may run anything. Race: if the parent died
before ``prctl`` ran, no signal will ever come, so the launcher then checks that its
parent is still the PID that spawned it and exits otherwise.

Caveat: the kernel sends the signal when the *thread* that forked the child exits, so
``spawn`` must run on the event loop's thread (it does; never call it via
``to_thread``). The launcher costs one extra interpreter start per child (about 15 ms here).

Synchronous callers (the test and benchmark launchers in ``preheat.testing``) use the
same pieces: ``start_process`` is ``spawn`` for code without an event loop (same
launcher, log handling and environment; a ``Process`` stops like a ``Child``), and
``wait_http`` runs the one wait loop, ``wait_http_ok``, on a private event loop. There is
one ``free_port``. A synchronous child started from a worker thread gets its
parent-death signal when that *thread* ends, so ``start_process`` refuses to arm it off
the main thread unless asked (``die_with_parent=False`` skips the launcher).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import aiohttp

__all__ = [
    "ANY_STATUS",
    "Child",
    "Process",
    "free_port",
    "launcher_argv",
    "preheat_command",
    "spawn",
    "start_process",
    "wait_http",
    "wait_http_ok",
]

_T = TypeVar("_T")

#: Runs in the child before the real command: parent-death signal, race check, exec.
_LAUNCHER = """\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
    sys.stderr.write(f"preheat launcher: prctl failed: {os.strerror(ctypes.get_errno())}\\n")
if os.getppid() != parent:  # the parent died before prctl: no signal would come
    sys.exit(f"preheat launcher: parent {parent} is gone; not starting {sys.argv[2]}")
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.exit(f"preheat launcher: cannot run {sys.argv[2]}: {exc}")
"""


def launcher_argv(argv: list[str]) -> list[str]:
    """``argv`` wrapped so the process gets SIGTERM when this process dies (Linux only;
    elsewhere ``argv`` unchanged)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *argv]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def preheat_command(*args: str) -> list[str]:
    """``preheat ARGS`` run by this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-c", "from preheat.cli import main; main()", *args]


def _child_env(env: Mapping[str, str] | None, *, inherit: bool = True) -> dict[str, str]:
    """The environment of a child: this process's (unless ``inherit`` is False) plus ``env``."""
    return {**(os.environ if inherit else {}), **(env or {})}


def _open_log(log: Path | None) -> int:
    """A descriptor that appends to ``log`` (created 0644 with its parents), or /dev/null."""
    if log is None:
        return os.open(os.devnull, os.O_WRONLY)
    log.parent.mkdir(parents=True, exist_ok=True)
    return os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def _send(pid: int, sig: int) -> None:
    """``kill(pid, sig)``, quiet when the process is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _tail(log: Path | None, lines: int) -> str:
    if log is None:
        return ""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


class Child:
    """One started process with its log file."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path, argv: list[str]) -> None:
        self.proc = proc
        self.log = log
        self.argv = argv

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def stop(self, timeout: float = 10.0, *, sig: int = signal.SIGTERM) -> int | None:
        """Signal the process (SIGTERM by default), wait, SIGKILL if it lingers."""
        if self.proc.returncode is None:
            _send(self.proc.pid, sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                _send(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        return self.proc.returncode

    def tail(self, lines: int = 5) -> str:
        """The last lines of the log (why a process died)."""
        return _tail(self.log, lines)


async def spawn(argv: list[str], log: Path, *, env: dict[str, str] | None = None) -> Child:
    """Start ``argv`` with stdout and stderr appended to ``log``, in a session of its
    own, and (on Linux) stopped with SIGTERM when this process dies."""
    fd = _open_log(log)
    try:
        proc = await asyncio.create_subprocess_exec(
            *launcher_argv(argv),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            env=_child_env(env),
        )
    finally:
        os.close(fd)
    return Child(proc, log, argv)


class Process:
    """A process started by ``start_process``: ``Child`` for synchronous callers."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        log: Path | None,
        argv: list[str],
        started_at: float,
    ) -> None:
        self.popen = popen
        self.log = log
        self.argv = argv
        #: Epoch time just before the process was started.
        self.started_at = started_at

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    @property
    def stdin(self) -> IO[bytes] | None:
        return self.popen.stdin

    def wait(self, timeout: float) -> int | None:
        """Its exit code once it exits within ``timeout`` seconds, else None."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 10.0, *, sig: int = signal.SIGTERM) -> int | None:
        """Signal the process (SIGTERM by default), wait, SIGKILL if it lingers; safe to
        call twice."""
        if self.popen.poll() is None:
            _send(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                _send(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode

    def tail(self, lines: int = 5) -> str:
        """The last lines of the log (why a process died)."""
        return _tail(self.log, lines)


def start_process(
    argv: list[str],
    log: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    inherit_env: bool = True,
    stdin_pipe: bool = False,
    die_with_parent: bool | None = None,
) -> Process:
    """``spawn`` without an event loop: start ``argv`` in a session of its own with stdout
    and stderr appended to ``log`` (``None``: discarded).

    ``die_with_parent`` (default: on the main thread only) wraps ``argv`` in the
    parent-death launcher; the kernel signals when the starting *thread* ends, so a
    worker thread must not arm it for a process that outlives the thread.
    """
    if die_with_parent is None:
        die_with_parent = threading.current_thread() is threading.main_thread()
    fd = _open_log(log)
    started_at = time.time()
    try:
        popen = subprocess.Popen(
            launcher_argv(argv) if die_with_parent else list(argv),
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            env=_child_env(env, inherit=inherit_env),
        )
    finally:
        os.close(fd)
    return Process(popen, log, list(argv), started_at)


class _Running(Protocol):
    @property
    def running(self) -> bool: ...


def ANY_STATUS(status: int) -> bool:
    """Accept any HTTP answer as "up" (a 404 or 503 on the probe URL still means it listens)."""
    return True


def _is_200(status: int) -> bool:
    return status == 200


async def wait_http_ok(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout: float,
    child: _Running | None = None,
    interval: float = 0.05,
    accept: Callable[[int], bool] = _is_200,
) -> bool:
    """Poll ``url`` until it answers 200 (or a status ``accept`` takes); False when
    ``child`` exits or time runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if child is not None and not child.running:
            return False
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if accept(resp.status):
                    return True
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass
        await asyncio.sleep(interval)
    return False


def _run_blocking(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion on a private event loop, also from inside a running
    one (then on a short-lived thread, as the caller blocks anyway)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(asyncio.run(coro))
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=run, name="preheat-wait-http")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return box[0]


def wait_http(
    url: str,
    *,
    timeout: float,
    child: _Running | None = None,
    accept: Callable[[int], bool] = _is_200,
    interval: float = 0.05,
) -> bool:
    """``wait_http_ok`` for synchronous callers (the same loop on a private event loop)."""

    async def run() -> bool:
        async with aiohttp.ClientSession() as session:
            return await wait_http_ok(
                session, url, timeout=timeout, child=child, accept=accept, interval=interval
            )

    return _run_blocking(run())
