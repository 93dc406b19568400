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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp

__all__ = ["Child", "free_port", "launcher_argv", "preheat_command", "spawn", "wait_http_ok"]

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
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        return self.proc.returncode

    def tail(self, lines: int = 5) -> str:
        """The last lines of the log (why a process died)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


async def spawn(argv: list[str], log: Path, *, env: dict[str, str] | None = None) -> Child:
    """Start ``argv`` with stdout and stderr appended to ``log``, in a session of its
    own, and (on Linux) stopped with SIGTERM when this process dies."""
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        proc = await asyncio.create_subprocess_exec(
            *launcher_argv(argv),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    finally:
        os.close(fd)
    return Child(proc, log, argv)


async def wait_http_ok(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout: float,
    child: Child | None = None,
    interval: float = 0.05,
) -> bool:
    """Poll ``url`` until it answers 200; False when ``child`` exits or time runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if child is not None and not child.running:
            return False
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return True
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass
        await asyncio.sleep(interval)
    return False
