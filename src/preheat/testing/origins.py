"""Real origins on 127.0.0.1 for tests and benchmarks: nginx (HTTP with Range) and an S3 API.

Both are context managers that pick a free port, wait until the server answers, and stop
the server they started by its PID on exit::

    with nginx_origin(root_dir, limit_rate=50_000_000) as origin:
        url = origin.url("model/preheat-manifest.json")

    with s3_origin() as s3:
        client = s3.client()
        client.create_bucket(Bucket="models")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from aiohttp import web

from .procs import free_port, start_server

__all__ = [
    "NGINX",
    "HttpOrigin",
    "S3Origin",
    "free_port",
    "nginx_origin",
    "origin_bytes_sent",
    "s3_origin",
]

NGINX = os.environ.get("PREHEAT_NGINX", "/usr/sbin/nginx")


def origin_bytes_sent(access_log: Path) -> int:
    """Body bytes an ``nginx_origin(access_log=...)`` sent, summed over its log."""
    if not access_log.exists():
        return 0
    return sum(int(line.split(" ", 1)[0]) for line in access_log.read_text().splitlines() if line)


@dataclass(frozen=True)
class HttpOrigin:
    """A running nginx serving ``root`` at ``base_url``."""

    root: Path
    port: int
    pid: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, relpath: str = "") -> str:
        return f"{self.base_url}/{relpath.lstrip('/')}"


_NGINX_CONF = """
{user}
daemon off;
master_process on;
worker_processes {workers};
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    {access}
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ application/json json; application/octet-stream safetensors bin; }}
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{
            {limit}
        }}
    }}
}}
"""


@contextlib.contextmanager
def nginx_origin(
    root: Path,
    *,
    limit_rate: int | None = None,
    workers: int = 2,
    port: int | None = None,
    access_log: Path | None = None,
) -> Iterator[HttpOrigin]:
    """Serve ``root`` with nginx on 127.0.0.1 (Range requests included).

    ``limit_rate`` caps each connection's bytes per second (nginx ``limit_rate``), which
    turns the local nginx into a slow remote origin for fault and fleet tests.
    ``access_log``: one line per request, ``<body bytes sent> <status> <uri>``, so a
    test or benchmark counts what left the origin (``origin_bytes_sent``).
    """
    if not Path(NGINX).exists():
        raise RuntimeError(
            f"nginx not found at {NGINX}; run scripts/install-sysdeps.sh (Debian nginx-light)"
        )
    tmp = Path(tempfile.mkdtemp(prefix="preheat-nginx-"))
    limit = f"limit_rate {int(limit_rate)};" if limit_rate else ""
    access = (
        f"log_format sent '$body_bytes_sent $status $uri'; access_log {access_log} sent;"
        if access_log is not None
        else "access_log off;"
    )
    conf = tmp / "nginx.conf"
    # As root, nginx workers would drop to 'nobody' and could not read private temp dirs.
    user = ""
    if os.geteuid() == 0:
        import grp
        import pwd

        user = f"user {pwd.getpwuid(0).pw_name} {grp.getgrgid(os.getegid()).gr_name};"

    def argv(p: int) -> list[str]:
        conf.write_text(
            _NGINX_CONF.format(
                user=user,
                workers=workers,
                tmp=tmp,
                port=p,
                root=Path(root).resolve(),
                limit=limit,
                access=access,
            )
        )
        return [NGINX, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")]

    try:
        proc, port = start_server(
            argv, port=port, health="/", log=tmp / "stderr.log", timeout=10, what="nginx"
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        yield HttpOrigin(root=Path(root), port=port, pid=proc.pid)
    finally:
        proc.stop(10, sig=signal.SIGQUIT)  # graceful: the master waits for its workers
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class S3Origin:
    """A running S3-API server (moto) at ``endpoint_url``."""

    endpoint_url: str
    pid: int | None

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )


@contextlib.contextmanager
def s3_origin(port: int | None = None) -> Iterator[S3Origin]:
    """Run moto's S3 server in a child process on 127.0.0.1; stopped by PID on exit.

    Sets the dummy AWS credentials the server accepts in this process's environment for
    the duration, so ``preheat cache pull s3://...`` subprocesses inherit them.
    """
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

    def argv(p: int) -> list[str]:
        code = (
            "import sys\n"
            "from moto.server import ThreadedMotoServer\n"
            f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={p})\n"
            "s.start()\n"
            "sys.stdin.read()\n"
            "s.stop()\n"
        )
        return [sys.executable, "-c", code]

    proc, port = start_server(
        argv, port=port, health="/", env=env, stdin_pipe=True, timeout=30, what="moto S3"
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield S3Origin(endpoint_url=f"http://127.0.0.1:{port}", pid=proc.pid)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if proc.stdin is not None:  # EOF on stdin: the server stops itself
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if proc.wait(5) is None:
            proc.stop()


class AppInThread:
    """Serve every method and path with ``handler`` (aiohttp) on 127.0.0.1, on an event loop
    in a thread of its own: the base of test origins that misbehave on purpose (ignore
    conditional headers, fail the first range, demand Basic auth). Use as a context
    manager; ``port`` is chosen at construction."""

    def __init__(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.port = free_port()
        self._handler = handler
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> Self:
        async def start() -> None:
            app = web.Application()
            app.router.add_route("*", "/{path:.*}", self._handler)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        self._thread.start()
        asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
