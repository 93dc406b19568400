"""hf:// pulls into the node store from the test Hub on 127.0.0.1 (preheat.testing.hub)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.errors import DigestMismatch, GitBlobMismatch, RevisionChanged
from preheat.store import NodeStore
from preheat.testing.hub import HubRepos, HubServer, hub_server

SHARD1 = os.urandom(3_000_000)
SHARD2 = os.urandom(2_000_000)
V1 = {
    "config.json": b'{"hidden_size": 64}\n',
    "tokenizer/tokenizer.json": b'{"version": "1.0"}\n' * 100,
    "model-00001-of-00002.safetensors": SHARD1,
    "model-00002-of-00002.safetensors": SHARD2,
    "original/consolidated.pth": os.urandom(500_000),
}
PREHEAT = str(Path(sys.executable).with_name("preheat"))
CONFIG2 = b'{"hidden_size": 128}\n'


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubServer, HubRepos, dict]]:
    root = tmp_path_factory.mktemp("hub")
    repos = HubRepos(root)
    shas = {"v1": repos.commit("acme/tiny", V1, tag="v1.0")}
    shas["v2"] = repos.commit("acme/tiny", {"config.json": CONFIG2})
    with hub_server(root, page_size=3) as server:
        yield server, repos, shas


@pytest.fixture
def endpoint(hub: tuple[HubServer, HubRepos, dict], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HF_ENDPOINT", hub[0].url)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    return hub[0].url


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_pull_by_tag_then_branch_fetches_each_file_once(
    hub: tuple[HubServer, HubRepos, dict], endpoint: str, tmp_path: Path
) -> None:
    """A tag resolves to its commit (the revision), main to the next one, and only the changed file is fetched again."""
    server, _, shas = hub
    store = NodeStore(tmp_path / "store", fsync=False)
    first = store.pull("hf://acme/tiny@v1.0", chunk=1 << 20)
    assert first.revision == f"hf:{shas['v1']}"
    assert _files(first.snapshot) == V1
    assert first.bytes_fetched == sum(map(len, V1.values()))
    latest = json.loads(
        next((tmp_path / "store/refs").glob("hf_acme_tiny_v1.0_*")).joinpath("latest").read_text()
    )
    assert (latest["revision"], latest["label"]) == (first.revision, "v1.0")

    second = store.pull("hf://acme/tiny", chunk=1 << 20)
    assert second.revision == f"hf:{shas['v2']}"
    assert _files(second.snapshot) == {**V1, "config.json": CONFIG2}
    assert second.bytes_fetched == len(CONFIG2)
    resolved = [p for m, p, *_ in server.requests() if "/resolve/" in p]
    assert resolved and all(
        f"/resolve/{shas['v1']}/" in p or f"/resolve/{shas['v2']}/" in p for p in resolved
    )
    again = store.pull("hf://acme/tiny")
    assert (again.bytes_fetched, again.manifest_digest) == (0, second.manifest_digest)


def test_lfs_shards_fill_in_parallel_ranges_from_the_storage_host(
    hub: tuple[HubServer, HubRepos, dict], endpoint: str, tmp_path: Path
) -> None:
    """Each shard comes from the storage host in chunk-sized ranges, and the token-free redirect is followed."""
    server = hub[0]
    before = len(server.requests("storage"))
    NodeStore(tmp_path / "store", fsync=False).pull("hf://acme/tiny@v1.0", chunk=1 << 20)
    gets = [r for r in server.requests("storage")[before:] if r[0] == "GET"]
    shard1 = hashlib.sha256(SHARD1).hexdigest()
    ranges = [r for r in gets if f"/lfs/{shard1}?" in r[1]]
    assert len(ranges) == 3 and {r[2] for r in ranges} == {206}
    assert sum(r[3] for r in ranges) == len(SHARD1)
    assert all(r[4] == "-" for r in gets)


def test_include_exclude_select_files_and_name_another_revision(
    hub: tuple[HubServer, HubRepos, dict], endpoint: str, tmp_path: Path
) -> None:
    """#include/#exclude keep only the matching files, under a revision of their own."""
    _, _, shas = hub
    store = NodeStore(tmp_path / "store", fsync=False)
    res = store.pull("hf://acme/tiny@v1.0#include=*.safetensors&include=*.json&exclude=tokenizer/")
    assert set(_files(res.snapshot)) == {
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    assert res.revision.startswith(f"hf:{shas['v1']}+")


def test_a_pinned_revision_refuses_a_moved_branch(
    hub: tuple[HubServer, HubRepos, dict], endpoint: str, tmp_path: Path
) -> None:
    """An endpoint pinned to one commit of main refuses to pull once main moved, before fetching."""
    repos = hub[1]
    repos.commit("acme/moving", {"config.json": b"1"})
    store = NodeStore(tmp_path / "store", fsync=False)
    pinned = store.pull("hf://acme/moving").revision
    repos.commit("acme/moving", {"config.json": b"2"})
    with pytest.raises(RevisionChanged, match="hf://acme/moving"):
        store.pull("hf://acme/moving", revision=pinned)


def test_bytes_that_do_not_match_the_hub_listing_are_refused(
    hub: tuple[HubServer, HubRepos, dict], endpoint: str, tmp_path: Path
) -> None:
    """A git file that differs from its blob id and an LFS file that differs from its sha256 publish nothing."""
    server, repos, _ = hub
    repos.commit("acme/bad", {"config.json": b'{"a": 1}', "w.safetensors": b"w" * 100_000})
    objects = server.root / "objects"
    git_obj = next(p for p in objects.iterdir() if p.read_bytes() == b'{"a": 1}')
    lfs_obj = objects / hashlib.sha256(b"w" * 100_000).hexdigest()
    store = NodeStore(tmp_path / "store", fsync=False, retries=0)
    try:
        git_obj.write_bytes(b'{"a": 2}')
        with pytest.raises(GitBlobMismatch, match=r"config\.json"):
            store.pull("hf://acme/bad#include=*.json")
        lfs_obj.write_bytes(b"x" * 100_000)
        with pytest.raises(DigestMismatch, match=r"w\.safetensors"):
            store.pull("hf://acme/bad#include=*.safetensors")
    finally:
        git_obj.write_bytes(b'{"a": 1}')
        lfs_obj.write_bytes(b"w" * 100_000)
    assert store.snapshots() == []


def test_cli_pull_with_include_and_json(
    hub: tuple[HubServer, HubRepos, dict], endpoint: str, tmp_path: Path
) -> None:
    """`preheat cache pull hf://... --include/--exclude --json` with HF_ENDPOINT from the environment."""
    _, _, shas = hub
    out = subprocess.run(
        [
            PREHEAT,
            "cache",
            "pull",
            "hf://acme/tiny@v1.0",
            "--store",
            str(tmp_path / "store"),
            "--include",
            "*.json",
            "--exclude",
            "tokenizer/*",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["revision"].startswith(f"hf:{shas['v1']}+")
    assert _files(Path(result["snapshot"])) == {"config.json": V1["config.json"]}


async def test_local_fleet_warms_nodes_from_an_hf_source(
    hub: tuple[HubServer, HubRepos, dict], endpoint: str, tmp_path: Path
) -> None:
    """An endpoint spec with an hf:// source pins the commit, warms both nodes from the Hub and serves."""
    from preheat.runtime.local import LocalFleet
    from preheat.testing.fleet import cluster_spec, endpoint_spec, run_load

    _, _, shas = hub
    spec = endpoint_spec("chat", "hf://acme/tiny@v1.0", replicas=2, cache={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a", "b"], slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        assert fleet.status()["variants"][0]["revision"] == f"hf:{shas['v1']}"
        load = await run_load(fleet.router.url, requests=4, concurrency=2)
        assert load.failed == 0
    for node in ("a", "b"):
        snap = NodeStore(tmp_path / "nodes" / node).snapshot_path(f"hf:{shas['v1']}")
        assert _files(snap) == V1


def test_an_expired_storage_url_is_resolved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signed storage URLs that expire mid-pull (403) are fetched again through /resolve, and the pull completes."""
    repos = HubRepos(tmp_path / "hub")
    payload = SHARD1[:2_000_000]  # the first 1 MiB passes as the rate limiter's burst
    repos.commit("acme/slow", {"w.safetensors": payload})
    with hub_server(repos.root, url_ttl=1.0) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        store = NodeStore(tmp_path / "store", fsync=False)
        res = store.pull("hf://acme/slow", chunk=128 << 10, rate_limit=500_000, connections=2)
        assert (res.snapshot / "w.safetensors").read_bytes() == payload
        statuses = [r[2] for r in server.requests("storage") if r[0] == "GET"]
        resolves = [p for m, p, *_ in server.requests() if m == "HEAD" and "/resolve/" in p]
    assert 403 in statuses and len(resolves) >= 2
