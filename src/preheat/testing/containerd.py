"""A real containerd (Debian's ``containerd`` 1.6) for tests: its own root, state and
socket under a temp dir, the CRI plugin off (no kubelet here), stopped by PID::

    with containerd(tmp / "ctd") as ctd:
        hosts = ctd.hosts_dir({"127.0.0.1:5000": "http://127.0.0.1:5001"})
        ctd.ctr("images", "pull", "--hosts-dir", str(hosts), "--snapshotter", "native",
                "127.0.0.1:5000/team/app:v1")

The ``hosts.toml`` files come from ``runtime.kubernetes.mirror_config`` (what ``preheat
k8s render --containerd-mirror`` puts on a node), so the test checks that rendering too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from preheat.runtime.kubernetes.mirror_config import mirror_files

from .procs import Process

CONTAINERD = os.environ.get(
    "PREHEAT_CONTAINERD", shutil.which("containerd") or "/usr/bin/containerd"
)
CTR = os.environ.get("PREHEAT_CTR", shutil.which("ctr") or "/usr/bin/ctr")

_CONFIG = """version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{sock}"
"""


@dataclass
class Containerd:
    """A running containerd at ``address`` (a unix socket)."""

    base: Path
    address: Path
    proc: Process | None = field(default=None, repr=False)

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``ctr --address SOCK ARGS``; raises with its stderr on failure."""
        argv = [CTR, "--address", str(self.address), *args]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
            )
        return proc

    def hosts_dir(self, mirrors: Mapping[str, str]) -> Path:
        """A ``--hosts-dir`` sending each registry (``host:port``) to its mirror URL."""
        d = self.base / "certs.d"
        for registry, mirror in mirrors.items():
            for path, text in mirror_files([registry], mirror, str(d)).items():
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(text)
        return d


@contextlib.contextmanager
def containerd(base: Path, *, timeout: float = 30) -> Iterator[Containerd]:
    """Start containerd with everything under ``base``; wait until ``ctr version``
    answers; stop it by PID on exit."""
    from preheat.runtime.procs import start_process

    for exe in (CONTAINERD, CTR):
        if not Path(exe).exists():
            raise RuntimeError(f"{exe} not found; run scripts/install-sysdeps.sh (containerd)")
    base.mkdir(parents=True, exist_ok=True)
    sock = base / "containerd.sock"
    conf = base / "config.toml"
    conf.write_text(_CONFIG.format(root=base / "root", state=base / "state", sock=sock))
    proc = start_process([CONTAINERD, "--config", str(conf)], base / "containerd.log")
    ctd = Containerd(base, sock, proc)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if not proc.running:
                raise RuntimeError(f"containerd exited ({proc.returncode}):\n{proc.tail(20)}")
            try:
                ctd.ctr("version", timeout=10)
                break
            except (RuntimeError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"containerd did not answer within {timeout:.0f} s:\n{proc.tail(20)}"
                    ) from None
                time.sleep(0.2)
        yield ctd
    finally:
        proc.stop(10)
