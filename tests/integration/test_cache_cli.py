"""``preheat cache``: the commands end to end as a user runs them (real processes, real nginx)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.bench.models import generate_model
from preheat.store import NodeStore
from preheat.testing.origins import HttpOrigin, nginx_origin

MiB = 1 << 20
PREHEAT = str(Path(sys.executable).with_name("preheat"))


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([PREHEAT, *args], capture_output=True, text=True, timeout=60)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, HttpOrigin]]:
    root = tmp_path_factory.mktemp("origin")
    generate_model(root / "a", 6 * MiB, 2, seed=1)
    generate_model(root / "b", 6 * MiB, 2, seed=2)
    run("cache", "manifest", str(root / "a"))
    run("cache", "manifest", str(root / "b"))
    with nginx_origin(root) as o:
        yield root, o


def test_help_explains_sources_and_layout() -> None:
    """--help names every source form and the on-disk layout."""
    out = run("cache", "--help").stdout
    assert "snapshots/<digest>/" in out and "pull" in out and "evict" in out
    pull = run("cache", "pull", "--help").stdout
    for form in ("file:///abs/dir", "preheat-manifest.json", "s3://bucket/prefix", "--capacity"):
        assert form in pull


def test_pull_json_ls_pin_evict(tmp_path: Path, origin: tuple[Path, HttpOrigin]) -> None:
    """pull --json prints the result keys; ls shows it; pins hold; evict frees by plan."""
    _, o = origin
    store = str(tmp_path / "s")
    a = json.loads(
        run("cache", "pull", o.url("a/preheat-manifest.json"), "--store", store, "--json").stdout
    )
    assert {
        "snapshot",
        "revision",
        "manifest_digest",
        "bytes_fetched",
        "bytes_reused",
        "seconds",
    } <= set(a)
    assert Path(a["snapshot"]).is_dir() and a["bytes_fetched"] >= 6 * MiB
    plain = run("cache", "pull", o.url("b/preheat-manifest.json"), "--store", store)
    b_snap = plain.stdout.strip()
    assert Path(b_snap).is_dir() and "fetched" in plain.stderr
    listing = json.loads(run("cache", "ls", "--store", store, "--json").stdout)
    digests = {s["manifest_digest"] for s in listing["snapshots"]}
    assert all(s["labels"] == [] for s in listing["snapshots"])  # no declared revision
    assert digests == {a["manifest_digest"], Path(b_snap).name}
    assert listing["eviction_order"][0] == a["manifest_digest"]  # least recently used first
    table = run("cache", "ls", "--store", store).stdout
    assert a["manifest_digest"][:16] in table and "next eviction" in table

    run("cache", "priority", Path(b_snap).name, "5", "--store", store)
    listing = json.loads(run("cache", "ls", "--store", store, "--json").stdout)
    assert listing["eviction_order"][0] == a["manifest_digest"]
    assert {s["priority"] for s in listing["snapshots"]} == {0, 5}
    run("cache", "priority", "--store", store, "--", Path(b_snap).name, "-1")
    listing = json.loads(run("cache", "ls", "--store", store, "--json").stdout)
    assert listing["eviction_order"][0] == Path(b_snap).name  # low priority goes first
    run("cache", "pin", a["manifest_digest"][:12], "--store", store)
    dry = run("cache", "evict", "--store", store, "--free", "1MiB", "--dry-run").stdout
    assert f"evict snapshot {Path(b_snap).name}" in dry and a["manifest_digest"] not in dry
    assert NodeStore(Path(store)).has(Path(b_snap).name)  # dry run changed nothing
    run("cache", "evict", "--store", store, "--free", "1MiB")
    s = NodeStore(Path(store))
    assert not s.has(Path(b_snap).name) and s.has(a["manifest_digest"])
    too_much = run("cache", "evict", "--store", store, "--free", "1GiB").stdout
    assert "NOT enough" in too_much and s.has(a["manifest_digest"])
    run("cache", "unpin", a["manifest_digest"], "--store", store)
    assert s.snapshots()[0].pinned is False


def test_pull_refused_for_capacity_exits_1(tmp_path: Path, origin: tuple[Path, HttpOrigin]) -> None:
    """Too little capacity: exit code 1 and one clear line with the numbers, no traceback."""
    _, o = origin
    p = run(
        "cache",
        "pull",
        o.url("a/preheat-manifest.json"),
        "--store",
        str(tmp_path / "s"),
        "--capacity",
        "2MiB",
        ok=False,
    )
    assert p.returncode == 1
    assert "InsufficientSpace" in p.stderr and "needs 6.0 MiB" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("ftp://host/x", "unsupported scheme"),
        ("file://relative/path", "three slashes"),
        ("s3://Bad_Bucket/x", "bucket name"),
    ],
)
def test_bad_source_is_one_clear_line(tmp_path: Path, source: str, message: str) -> None:
    """A malformed source fails with exit 1, naming the value and the fix."""
    p = run("cache", "pull", source, "--store", str(tmp_path / "s"), ok=False)
    assert p.returncode == 1 and message in p.stderr and source in p.stderr
    assert "Traceback" not in p.stderr


def test_unusable_store_dir(tmp_path: Path) -> None:
    """A store path that is a file fails with one line naming it."""
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    p = run("cache", "ls", "--store", str(f / "store"), ok=False)
    assert p.returncode == 1 and "cannot use" in p.stderr and "Traceback" not in p.stderr


def test_verify_and_rm_refuses_leased(tmp_path: Path, origin: tuple[Path, HttpOrigin]) -> None:
    """verify exits 0 on a healthy store and 1 after corruption; rm refuses a leased snapshot."""
    _, o = origin
    store = tmp_path / "s"
    a = json.loads(
        run(
            "cache", "pull", o.url("a/preheat-manifest.json"), "--store", str(store), "--json"
        ).stdout
    )
    assert json.loads(run("cache", "verify", "--store", str(store), "--json").stdout)["ok"]
    NodeStore(store).lease(a["manifest_digest"], "replica-7")
    p = run("cache", "rm", a["manifest_digest"], "--store", str(store), ok=False)
    assert p.returncode == 1 and "replica-7" in p.stderr
    NodeStore(store).release(a["manifest_digest"], "replica-7")
    blob = max(store.glob("blobs/sha256/??/*"), key=lambda q: q.stat().st_size)
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        f.write(b"corrupt!")
    bad = run("cache", "verify", "--store", str(store), ok=False)
    assert bad.returncode == 1 and f"CORRUPT blob {blob.name}" in bad.stdout
    assert f"repaired blob {blob.name}" in bad.stdout  # fetched again from the origin
    assert run("cache", "ls", "--store", str(store), "--json").stdout.count("manifest_digest") == 1
    run("cache", "rm", "0" * 64, "--store", str(store), ok=False)
