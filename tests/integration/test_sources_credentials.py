"""Credentials in source URLs (userinfo, presigned query strings) never leak, and are used.

A failing pull names the origin (scheme, host, path) but neither the password nor the
signature: not in the exception text (its whole chain), not on the CLI's stderr, not in
any log record. The zero-copy HTTP path sends the URL's userinfo as Basic auth, as the
aiohttp path does.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from aiohttp import web

from preheat.errors import ObjectNotFound, OriginUnavailable
from preheat.store import NodeStore
from preheat.testing.origins import AppInThread, free_port, nginx_origin

PREHEAT = str(Path(sys.executable).with_name("preheat"))
SECRETS = ("pw", "secret")


def _url(port: int, name: str = "m/w.bin") -> str:
    return f"http://user:pw@127.0.0.1:{port}/{name}?X-Amz-Signature=secret&X-Amz-Credential=AK"


def _assert_clean(text: str) -> None:
    for s in SECRETS:
        assert s not in text, f"{s!r} leaked into: {text}"


@pytest.fixture
def dead_port() -> int:
    return free_port()  # nothing listens there


@pytest.mark.parametrize("origin", ["404", "refused"])
def test_failed_pull_redacts_url_credentials(
    tmp_path: Path, origin: str, dead_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A 404 or refused origin: the error (and its causes) and every log record name the
    origin without the password or signature."""
    caplog.set_level(logging.DEBUG)
    store = NodeStore(tmp_path / "store", retries=1, backoff=0.01)
    (tmp_path / "root").mkdir()
    with nginx_origin(tmp_path / "root") as o:
        port = o.port if origin == "404" else dead_port
        kind = ObjectNotFound if origin == "404" else OriginUnavailable
        with pytest.raises(kind) as err:
            store.pull(_url(port))
    text = "".join(traceback.format_exception(err.value))
    assert "127.0.0.1" in str(err.value) and "w.bin" in str(err.value)
    _assert_clean(text)
    _assert_clean(caplog.text)


@pytest.mark.parametrize("origin", ["404", "refused"])
def test_cli_pull_stderr_redacts_url_credentials(
    tmp_path: Path, origin: str, dead_port: int
) -> None:
    """``preheat cache pull`` of a URL with credentials fails with exit code 1 and a
    stderr line that names the origin but not the password or signature."""
    (tmp_path / "root").mkdir()
    with nginx_origin(tmp_path / "root") as o:
        port = o.port if origin == "404" else dead_port
        p = subprocess.run(
            [PREHEAT, "cache", "pull", _url(port), "--store", str(tmp_path / "store")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert p.returncode == 1, p.stderr
    assert "127.0.0.1" in p.stderr and ("404" in p.stderr or "reach" in p.stderr)
    _assert_clean(p.stderr + p.stdout)


class BasicAuthOrigin(AppInThread):
    """A file server that answers 401 without ``user:pw``."""

    def __init__(self, root: Path) -> None:
        super().__init__(self._handle)
        self.root = root
        self.denied = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        want = "Basic " + base64.b64encode(b"user:pw").decode()
        if request.headers.get("Authorization") != want:
            self.denied += 1
            return web.Response(status=401)
        return web.FileResponse(self.root / request.match_info["path"])


@pytest.mark.parametrize("path", ["splice", "aiohttp"])
def test_userinfo_is_sent_as_basic_auth_on_both_paths(tmp_path: Path, path: str) -> None:
    """A single-file URL with ``user:pw@`` is fetched with Basic auth on the zero-copy
    path as on the aiohttp path (no 401)."""
    root = tmp_path / "root"
    (root / "m").mkdir(parents=True)
    data = hashlib.sha256(b"auth").digest() * (1 << 16)  # 2 MiB
    (root / "m" / "w.bin").write_bytes(data)
    store = NodeStore(tmp_path / "store", retries=1, backoff=0.01)
    with BasicAuthOrigin(root) as o:
        r = store.pull(
            f"http://user:pw@127.0.0.1:{o.port}/m/w.bin",
            chunk=256 << 10,
            rate_limit=None if path == "splice" else 1e12,
        )
        assert o.denied == 0
    assert (r.snapshot / "w.bin").read_bytes() == data
