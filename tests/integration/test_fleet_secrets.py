"""No fleet secret on a command line, and the router's ways of reading its admin token.

``/proc/PID/cmdline`` is readable by every local user: a token there lets anyone add
their own instance URL to the router and receive users' prompts. Real processes
throughout (the fleet's router and simulated engines; the router CLI).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from preheat.runtime.control_api import ControlServer
from preheat.runtime.local import LocalFleet
from preheat.runtime.procs import free_port, preheat_command
from preheat.testing.fleet import cluster_spec, endpoint_spec, make_model

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children of children too), from /proc."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: list[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        out += kids
        frontier += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


async def test_fleet_children_carry_no_secret_on_argv(tmp_path: Path) -> None:
    """With a fleet serving, neither the router's admin token nor the control API token
    appears in /proc/PID/cmdline of the router or any child; the admin API answers with
    the token and refuses without it or with a wrong one."""
    model = make_model(tmp_path / "origin" / "m1", size=1 * MB, shards=1, seed=7)
    spec = endpoint_spec("chat", model.ref, replicas=2, cache={"enabled": True})
    async with LocalFleet(spec, cluster_spec(tmp_path, ["a"]), tmp_path / "state") as fleet:
        control = ControlServer(fleet)
        await control.start()
        try:
            await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
            router_child = fleet.router.child
            assert router_child is not None
            pids = _descendants(os.getpid())
            replica_pids = [r.child.pid for r in fleet.replicas.values() if r.child]
            assert router_child.pid in pids and len(replica_pids) == 2
            assert set(replica_pids) <= set(pids)
            secrets = {"admin": fleet.router.token, "control": control.token}
            for pid in pids:
                line = _cmdline(pid)
                for name, value in secrets.items():
                    assert value not in line, f"{name} token on argv of pid {pid}: {line[:200]}"
            assert "router serve" in _cmdline(router_child.pid)

            url = f"{fleet.router.url}/admin/config"
            async with aiohttp.ClientSession() as http:
                good = {"Authorization": f"Bearer {fleet.router.token}"}
                async with http.get(url, headers=good) as resp:
                    assert resp.status == 200
                    assert len((await resp.json())["variants"][0]["instances"]) == 2
                async with http.get(url) as resp:
                    assert resp.status == 401
                async with http.get(url, headers={"Authorization": "Bearer wrong"}) as resp:
                    assert resp.status == 401
        finally:
            await control.stop()


def _serve(*extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    argv = preheat_command("router", "serve", "--port", str(port))
    argv += ["--backend", "http://127.0.0.1:9", *extra]
    clean = {k: v for k, v in os.environ.items() if k != "PREHEAT_ADMIN_TOKEN"}
    proc = subprocess.Popen(
        argv,
        env={**clean, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, port


def _admin_status(port: int, token: str, proc: subprocess.Popen[str]) -> int:
    """The admin API's answer to ``token`` once the router listens (bounded wait)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/admin/config",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            with exc:
                return int(exc.code)
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the router did not listen within 30 s")


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


@pytest.mark.parametrize("how", ["env", "file"])
def test_router_reads_admin_token_from_env_or_private_file(tmp_path: Path, how: str) -> None:
    """The router takes its admin token from PREHEAT_ADMIN_TOKEN or a 0600 file, without
    a warning, and the admin API then accepts that token and refuses another."""
    token = "tok-" + os.urandom(8).hex()
    if how == "env":
        proc, port = _serve(env={"PREHEAT_ADMIN_TOKEN": token})
    else:
        path = tmp_path / "admin-token"
        path.write_text(token + "\n")
        path.chmod(0o600)
        proc, port = _serve("--admin-token-file", str(path))
    try:
        assert _admin_status(port, token, proc) == 200
        assert _admin_status(port, "other", proc) == 401
        assert token not in _cmdline(proc.pid)
    finally:
        err = _stop(proc)
    assert "visible to every local user" not in err


def test_router_refuses_a_token_file_others_can_read(tmp_path: Path) -> None:
    """An admin token file readable by group or others is refused with its mode and the
    chmod that fixes it; the router does not start."""
    path = tmp_path / "admin-token"
    path.write_text("secret-token-value\n")
    path.chmod(0o644)
    proc, _ = _serve("--admin-token-file", str(path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "0644" in err and f"chmod 600 {path}" in err
    assert "secret-token-value" not in err


def test_router_warns_about_a_token_on_argv(tmp_path: Path) -> None:
    """``--admin-token`` still works but warns that the token is visible to other users."""
    proc, port = _serve("--admin-token", "argv-token-1234")
    try:
        assert _admin_status(port, "argv-token-1234", proc) == 200
    finally:
        err = _stop(proc)
    assert "visible to every local user" in err and "PREHEAT_ADMIN_TOKEN" in err
