"""preheat.testing.hub is checked against the real client: huggingface_hub downloads from it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from preheat.testing.hub import HubRepos, HubServer, git_blob_id, hub_server

V1 = {
    "config.json": b'{"hidden_size": 64}\n',
    "tokenizer/tokenizer.json": b'{"version": "1.0"}\n' * 50,
    "model-00001-of-00002.safetensors": os.urandom(300_000),
    "model-00002-of-00002.safetensors": os.urandom(200_000),
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubServer, dict[str, str]]]:
    root = tmp_path_factory.mktemp("hub")
    repos = HubRepos(root)
    repos.add_token("hf_alice_token", "alice")
    shas = {"v1": repos.commit("acme/tiny", V1, tag="v1.0")}
    shas["v2"] = repos.commit("acme/tiny", {"config.json": b'{"hidden_size": 128}\n'})
    repos.create("acme/secret", private=True, readers=("alice",))
    repos.commit("acme/secret", {"config.json": b"{}"})
    repos.create("acme/gated", gated=True)
    repos.commit("acme/gated", {"config.json": b"{}"})
    with hub_server(root, page_size=2) as server:
        yield server, shas


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_snapshot_download_by_tag_gets_exactly_those_files(
    hub: tuple[HubServer, dict[str, str]], tmp_path: Path
) -> None:
    """snapshot_download of a tag returns that commit's files, byte for byte, from the pages of the tree."""
    server, shas = hub
    out = snapshot_download(
        "acme/tiny", revision="v1.0", endpoint=server.url, cache_dir=tmp_path, token=False
    )
    assert Path(out).name == shas["v1"]
    assert _files(Path(out)) == V1
    storage = server.requests("storage")
    assert {p.split("?")[0] for _, p, s, _, _ in storage if s == 200} >= {
        f"/lfs/{hashlib.sha256(V1['model-00001-of-00002.safetensors']).hexdigest()}"
    }


def test_snapshot_download_of_main_sees_the_new_commit(
    hub: tuple[HubServer, dict[str, str]], tmp_path: Path
) -> None:
    """main resolves to the second commit, which changed one file and kept the rest."""
    server, shas = hub
    out = snapshot_download("acme/tiny", endpoint=server.url, cache_dir=tmp_path, token=False)
    assert Path(out).name == shas["v2"]
    assert _files(Path(out)) == {**V1, "config.json": b'{"hidden_size": 128}\n'}


def test_tree_api_lists_lfs_sha256_and_git_blob_ids(hub: tuple[HubServer, dict[str, str]]) -> None:
    """list_repo_tree (three pages of two) gives sizes, git blob ids and LFS sha256 as the Hub does."""
    server, shas = hub
    api = HfApi(endpoint=server.url, token=False)
    files = {
        f.path: f
        for f in api.list_repo_tree("acme/tiny", revision=shas["v1"], recursive=True)
        if isinstance(f, huggingface_hub.hf_api.RepoFile)
    }
    assert set(files) == set(V1)
    shard = files["model-00001-of-00002.safetensors"]
    assert shard.lfs is not None
    assert shard.lfs.sha256 == hashlib.sha256(V1["model-00001-of-00002.safetensors"]).hexdigest()
    assert files["config.json"].lfs is None
    assert files["config.json"].blob_id == git_blob_id(V1["config.json"])
    assert files["config.json"].size == len(V1["config.json"])


def test_errors_are_the_hubs(hub: tuple[HubServer, dict[str, str]], tmp_path: Path) -> None:
    """Missing repo, missing revision, private and gated repos raise huggingface_hub's own errors."""
    server, _ = hub
    api = HfApi(endpoint=server.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/nothing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info("acme/tiny", revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/secret")
    with pytest.raises(GatedRepoError):
        api.model_info("acme/gated")
    with pytest.raises(GatedRepoError):
        HfApi(endpoint=server.url, token="hf_alice_token").model_info("acme/gated")
    secret = snapshot_download(
        "acme/secret", endpoint=server.url, cache_dir=tmp_path, token="hf_alice_token"
    )
    assert _files(Path(secret)) == {"config.json": b"{}"}
