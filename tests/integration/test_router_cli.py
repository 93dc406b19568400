"""`preheat router serve` as a real process: config file, admin API, stop by PID."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from preheat.testing.routers import launch_router, start_fast_backend, start_router

PREHEAT = str(Path(sys.executable).parent / "preheat")


def _post(url: str, body: dict) -> tuple[int, dict[str, str], bytes]:  # type: ignore[type-arg]
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def test_help_explains_the_options() -> None:
    """--help names the strategies, the admin token and the config file."""
    out = subprocess.run(
        [PREHEAT, "router", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for word in ("prefix_aware", "--admin-token", "--config", "--concurrency-threshold"):
        assert word in out.stdout


def test_a_bad_config_file_is_refused_with_the_reason(tmp_path: Path) -> None:
    """The message names the file, the variant and the bad value."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "variants:\n  - name: chat\n    strategy: prefix_aware\n    prefix_length: 100\n"
    )
    out = subprocess.run(
        [PREHEAT, "router", "serve", "--port", "1", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "variant 'chat'" in out.stderr and "prefix_length 100" in out.stderr


def test_empty_variant_then_admin_add_from_another_process(tmp_path: Path) -> None:
    """A variant with no instance answers 503 until the admin API adds one; the router
    process is stopped by PID."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "variants:\n  - name: chat\n    strategy: prefix_aware\n    prefix_length: 4096\n"
        "    instances: []\nhealth: {interval_s: 0.2}\n"
    )
    with start_fast_backend() as backend:
        r = launch_router(config=cfg, admin_token="tok", decision_log=tmp_path / "d.jsonl")
        try:
            status, headers, _ = _post(r.url + "/v1/completions", {"prompt": "hi"})
            assert status == 503 and headers["Retry-After"] == "1"
            with pytest.raises(urllib.error.HTTPError) as info:
                r.admin("GET", "/admin/config", token="wrong")
            assert info.value.code == 401
            info.value.close()
            doc = r.admin("POST", "/admin/instances/add", {"variant": "chat", "url": backend.url})
            assert doc["variants"][0]["instances"][0]["state"] == "healthy"
            status, headers, body = _post(r.url + "/v1/completions", {"prompt": "hi"})
            assert status == 200 and headers["X-Preheat-Instance"] == backend.url
            assert json.loads(body)["choices"][0]["text"] == "ok"
        finally:
            r.stop()
        assert r.proc.returncode is not None
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["instance"] == backend.url


def test_backends_from_the_command_line() -> None:
    """--backend URLs form one variant named 'default'."""
    with (
        start_fast_backend() as b1,
        start_fast_backend() as b2,
        start_router(backends=[b1.url, b2.url], strategy="least_outstanding", admin_token="t") as r,
    ):
        doc = r.admin("GET", "/admin/config")
        v = doc["variants"][0]
        assert v["name"] == "default" and v["strategy"] == "least_outstanding"
        assert {i["url"] for i in v["instances"]} == {b1.url, b2.url}
        seen = {
            _post(r.url + "/v1/completions", {"prompt": "x"})[1]["X-Preheat-Instance"]
            for _ in range(6)
        }
        assert seen <= {b1.url, b2.url}
