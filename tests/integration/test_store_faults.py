"""Faults during a fill: flaky origin (5xx, resets), SIGKILL then resume, two pullers at once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from preheat.bench.models import generate_model, write_http_manifest
from preheat.store import NodeStore
from preheat.testing.origins import AppInThread, nginx_origin

MiB = 1 << 20
PREHEAT = [str(Path(sys.executable).with_name("preheat"))]


class FlakyOrigin(AppInThread):
    """An aiohttp file server on 127.0.0.1: answers 503 to the first ranged GET of each
    file and cuts the connection halfway through the second."""

    def __init__(self, root: Path) -> None:
        super().__init__(self._handle)
        self.root = root
        self.requests: list[tuple[str, str]] = []
        self._seen: dict[str, int] = {}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["path"]
        path = self.root / name
        if not path.is_file():
            return web.Response(status=404)
        rng = request.headers.get("Range", "")
        self.requests.append((name, rng))
        data = path.read_bytes()
        if not rng:
            return web.Response(body=data)
        n = self._seen[name] = self._seen.get(name, 0) + 1
        a, b = rng.removeprefix("bytes=").split("-")
        start, end = int(a), int(b) + 1
        if n == 1:
            return web.Response(status=503, text="try later")
        resp = web.StreamResponse(status=206)
        resp.content_length = end - start
        resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        await resp.prepare(request)
        if n == 2 and end - start > 1000:
            await resp.write(data[start : start + (end - start) // 2])
            assert request.transport is not None
            request.transport.close()  # connection reset mid-body
            return resp
        await resp.write(data[start:end])
        return resp


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("origin")
    generate_model(root / "m", 48 * MiB, 3, seed=4)
    write_http_manifest(root / "m")
    return root


def _hashes(d: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in d.iterdir()
        if p.name != "preheat-manifest.json"
    }


@pytest.mark.parametrize("path", ["splice", "aiohttp"])
def test_retries_5xx_and_resets_then_verifies(tmp_path: Path, model: Path, path: str) -> None:
    """503s and a connection cut mid-body are retried with backoff; the result is verified.

    Both fetch paths: the zero-copy splice path, and aiohttp (taken when a rate limit is set).
    """
    store = NodeStore(tmp_path / "store", retries=3, backoff=0.01)
    with FlakyOrigin(model / "m") as origin:
        r = store.pull(
            f"http://127.0.0.1:{origin.port}/preheat-manifest.json",
            chunk=4 * MiB,
            connections=4,
            rate_limit=None if path == "splice" else 1e12,
        )
        failures = sum(1 for name, _ in origin.requests if name.endswith(".safetensors"))
    assert _hashes(r.snapshot) == _hashes(model / "m")
    assert failures > 12  # 12 chunks + at least one 503 and one cut per shard were retried
    # a cut range resumes from the byte where it stopped, so at most ~a chunk is refetched
    total = sum(p.stat().st_size for p in r.snapshot.iterdir())
    assert total <= r.bytes_fetched < total + 3 * 4 * MiB


def _pull_cmd(url: str, store: Path, *extra: str) -> list[str]:
    return [*PREHEAT, "cache", "pull", url, "--store", str(store), "--json", *extra]


def _run_json(cmd: list[str], timeout: float = 60) -> dict[str, object]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return dict(json.loads(p.stdout))


@pytest.fixture
def origin_url(model: Path) -> Iterator[str]:
    """nginx serving the model. The pulls below cap themselves with --rate-limit: nginx's
    own limit_rate lets each request send one second's worth at once (limit = rate x
    (elapsed + 1)), so ranged requests smaller than that are not slowed at all."""
    with nginx_origin(model) as o:
        yield o.url("m/preheat-manifest.json")


SLOW = ("--rate-limit", "16MB")  # 48 MiB take ~3 s


def test_sigkill_mid_fill_then_resume(tmp_path: Path, origin_url: str, model: Path) -> None:
    """A pull killed with SIGKILL leaves no snapshot; the next pull resumes and verifies."""
    store = tmp_path / "store"
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err:
        proc = subprocess.Popen(
            _pull_cmd(origin_url, store, "--chunk-size", "2MiB", *SLOW),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 30
        done = 0
        while time.monotonic() < deadline and done < 4:  # wait for 4 finished ranges
            assert proc.poll() is None, errors.read_text()
            done = 0
            for st in store.glob("tmp/*.json"):
                with contextlib.suppress(ValueError, OSError):  # mid-rename
                    done += len(json.loads(st.read_text())["done"])
            time.sleep(0.05)
        assert done >= 4, "the pull never got going"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    s = NodeStore(store)
    assert s.snapshots() == [] and not any(s.layout.snapshots.iterdir())
    out = _run_json(_pull_cmd(origin_url, store, "--chunk-size", "2MiB"))
    fetched, reused, resumed = (
        int(str(out[k])) for k in ("bytes_fetched", "bytes_reused", "bytes_resumed")
    )
    total = (
        sum(p.stat().st_size for p in (model / "m").iterdir())
        - (model / "m" / "preheat-manifest.json").stat().st_size
    )
    assert fetched + reused + resumed == total
    assert resumed + reused >= 4 * 2 * MiB  # the finished ranges were not fetched again
    assert fetched < total
    assert s.verify().ok
    assert _hashes(Path(str(out["snapshot"]))) == _hashes(model / "m")


def test_two_processes_same_pull_fetch_once(tmp_path: Path, origin_url: str) -> None:
    """Two processes pulling the same model into one store both succeed; bytes move once."""
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            _pull_cmd(origin_url, store, "--chunk-size", "4MiB", *SLOW),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=90)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    assert outs[0]["manifest_digest"] == outs[1]["manifest_digest"]
    assert all(o["seconds"] > 1.0 for o in outs)  # both really pulled at the same time
    total = outs[0]["bytes_fetched"] + outs[0]["bytes_reused"]
    assert outs[0]["bytes_fetched"] + outs[1]["bytes_fetched"] == total
    assert NodeStore(store).verify().ok
