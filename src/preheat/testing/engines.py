"""Start real engines on 127.0.0.1 for tests and benchmarks, and stop them by PID.

Simulated engines (``preheat engine serve`` in subprocesses)::

    with simulated_engines(3, profile="tiny", time_scale=0.01) as engines:
        urls = [e.url for e in engines]          # all healthy

llama.cpp's ``llama-server`` (built by ``scripts/build-llama-server.sh``)::

    binary = find_llama_server()                 # None when not built
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with llama_server(model, slots=2) as srv:
        ...

Every process gets its own free port (retrying if another process grabbed it first), a
log file, and is stopped with SIGTERM, then SIGKILL after a grace period, on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preheat.errors import EngineUnavailable

from .gguf_model import write_tiny_llama_gguf
from .procs import Process, free_port, start_server, wait_up

__all__ = [
    "EngineProcess",
    "engine_command",
    "find_llama_server",
    "free_port",
    "llama_server",
    "llama_server_missing_reason",
    "simulated_engines",
    "start_simulated_engine",
    "write_tiny_llama_gguf",
]

LLAMA_SERVER_ENV = "PREHEAT_LLAMA_SERVER"


@dataclass
class EngineProcess:
    """A started engine process."""

    process: Process
    port: int
    log_path: Path
    spawned_at: float
    """Epoch time just before the process was spawned."""
    host: str = "127.0.0.1"
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.process.popen

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 30.0) -> float:
        """Wait until ``/health`` is 200; returns the epoch time. Raises
        ``EngineUnavailable`` (with the log's tail) if the process dies or time runs out."""
        wait_up(
            self.process,
            self.url + "/health",
            timeout=timeout_s,
            accept=lambda status: status == 200,
            error=EngineUnavailable,
            what="engine",
        )
        return time.time()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; safe to call twice."""
        self.process.stop(grace_s)


def engine_command(
    port: int,
    *,
    profile: str = "tiny",
    time_scale: float = 0.01,
    host: str = "127.0.0.1",
    snapshot: Path | None = None,
    kv_blocks: int | None = None,
    max_num_seqs: int | None = None,
    model_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv that runs ``preheat engine serve`` with this interpreter."""
    cmd = [
        sys.executable,
        "-c",
        "import sys; from preheat.cli import main; sys.exit(main())",
        "engine",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--profile",
        profile,
        "--time-scale",
        repr(time_scale),
    ]
    if snapshot is not None:
        cmd += ["--snapshot", str(snapshot)]
    if kv_blocks is not None:
        cmd += ["--kv-blocks", str(kv_blocks)]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if model_name is not None:
        cmd += ["--model-name", model_name]
    return cmd + list(extra)


def _start(
    argv_for: Callable[[int], list[str]],
    log_dir: Path,
    name: str,
    *,
    port: int | None,
    wait: bool,
    timeout_s: float,
) -> EngineProcess:
    """Start one engine through ``start_server`` (a lost port race is retried)."""
    proc, p = start_server(
        argv_for,
        port=port,
        log=lambda p: log_dir / f"{name}-{p}.log",
        timeout=timeout_s,
        accept=lambda status: status == 200,
        error=EngineUnavailable,
        what=name,
        wait=wait,
    )
    assert proc.log is not None
    return EngineProcess(
        process=proc, port=p, log_path=proc.log, spawned_at=proc.started_at, args=proc.argv
    )


def start_simulated_engine(
    *,
    log_dir: Path,
    port: int | None = None,
    wait: bool = True,
    timeout_s: float = 30.0,
    **kw: Any,
) -> EngineProcess:
    """Start one simulated engine (see :func:`engine_command` for options).

    With ``wait`` it returns once ``/health`` is 200 (retrying on another port if the
    chosen one was taken). The caller must ``stop()`` it.
    """
    return _start(
        lambda p: engine_command(p, **kw),
        log_dir,
        "engine",
        port=port,
        wait=wait,
        timeout_s=timeout_s,
    )


@contextlib.contextmanager
def simulated_engines(
    n: int = 1,
    *,
    profile: str = "tiny",
    time_scale: float = 0.01,
    log_dir: Path | None = None,
    timeout_s: float = 30.0,
    **kw: Any,
) -> Iterator[list[EngineProcess]]:
    """Start ``n`` simulated engines in parallel, wait until all are healthy, stop them on exit."""
    tmp = None
    if log_dir is None:
        tmp = tempfile.mkdtemp(prefix="preheat-engines-")
        log_dir = Path(tmp)
    engines: list[EngineProcess] = []
    try:
        for _ in range(n):
            engines.append(
                start_simulated_engine(
                    log_dir=log_dir, wait=False, profile=profile, time_scale=time_scale, **kw
                )
            )
        for i, eng in enumerate(engines):
            try:
                eng.wait_healthy(timeout_s)
            except EngineUnavailable:
                # Lost a port race: replace that one engine.
                eng.stop()
                engines[i] = start_simulated_engine(
                    log_dir=log_dir,
                    profile=profile,
                    time_scale=time_scale,
                    timeout_s=timeout_s,
                    **kw,
                )
        yield engines
    finally:
        for eng in engines:
            eng.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# --- llama.cpp ----------------------------------------------------------------------------


def _cache_root() -> Path:
    return Path(os.environ.get("PREHEAT_CACHE") or Path.home() / ".cache" / "preheat")


def find_llama_server() -> Path | None:
    """``$PREHEAT_LLAMA_SERVER``, the build script's cache, or ``llama-server`` on PATH."""
    env = os.environ.get(LLAMA_SERVER_ENV)
    candidates = [Path(env)] if env else []
    candidates.append(_cache_root() / "llama-server" / "current" / "bin" / "llama-server")
    on_path = shutil.which("llama-server")
    if on_path:
        candidates.append(Path(on_path))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def llama_server_missing_reason() -> str | None:
    """None when llama-server is available, else why not and how to get it."""
    if find_llama_server() is not None:
        return None
    return (
        "llama-server binary not found (looked at $PREHEAT_LLAMA_SERVER, "
        f"{_cache_root() / 'llama-server/current/bin/llama-server'} and PATH); "
        "build it with scripts/build-llama-server.sh (make test does)"
    )


@contextlib.contextmanager
def llama_server(
    model: Path,
    *,
    slots: int = 2,
    ctx_size: int = 4096,
    alias: str | None = None,
    log_dir: Path | None = None,
    timeout_s: float = 60.0,
    extra: Sequence[str] = (),
    wait: bool = True,
) -> Iterator[EngineProcess]:
    """Run ``llama-server`` on ``model``: ``-np slots --cache-ram 0 --metrics -t 1 -tb 1``.

    ``-np N --cache-ram 0`` gives exactly N slots of prompt cache (no host-RAM cache), and
    one thread keeps timings stable on small machines.
    """
    binary = find_llama_server()
    if binary is None:
        raise EngineUnavailable(llama_server_missing_reason() or "llama-server not found")
    tmp = None
    if log_dir is None:
        tmp = tempfile.mkdtemp(prefix="preheat-llama-")
        log_dir = Path(tmp)
    srv: EngineProcess | None = None
    try:

        def argv(port: int) -> list[str]:
            return [
                str(binary),
                "-m", str(model),
                "--host", "127.0.0.1",
                "--port", str(port),
                "-np", str(slots),
                "-c", str(ctx_size),
                "--cache-ram", "0",
                "--metrics",
                "-t", "1",
                "-tb", "1",
                "--no-webui",
                *(["--alias", alias] if alias else []),
                *extra,
            ]  # fmt: skip

        srv = _start(argv, log_dir, "llama-server", port=None, wait=wait, timeout_s=timeout_s)
        assert srv is not None
        yield srv
    finally:
        if srv is not None:
            srv.stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
