"""hf:// errors say which problem it is and how to fix it; the token never shows anywhere."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.errors import HubAccessDenied, HubRepoNotFound, HubRevisionNotFound
from preheat.store import NodeStore
from preheat.testing.hub import HubRepos, HubServer, hub_server

ALICE = "hf_alice_secret_0123456789"  # may read acme/private and acme/gated
BOB = "hf_bob_secret_9876543210"  # a valid token without access


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("hub")
    repos = HubRepos(root)
    repos.add_token(ALICE, "alice")
    repos.add_token(BOB, "bob")
    repos.commit("acme/public", {"config.json": b"{}"})
    repos.create("acme/private", private=True, readers=("alice",))
    repos.commit("acme/private", {"config.json": b'{"p": 1}', "w.safetensors": b"p" * 4096})
    repos.create("acme/gated", gated=True, readers=("alice",))
    repos.commit("acme/gated", {"config.json": b'{"g": 1}', "w.safetensors": b"g" * 4096})
    with hub_server(root) as server:
        yield server


@pytest.fixture
def env(hub: HubServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return monkeypatch


def _everything_written(root: Path) -> str:
    """Names and text of every file under ``root`` (the store: refs, db, tmp)."""
    out = []
    for p in root.rglob("*"):
        out.append(str(p))
        if p.is_file():
            out.append(p.read_bytes().decode("latin-1"))
    return "\n".join(out)


def test_missing_repo_and_revision_are_named(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A repo that does not exist and a branch that does not exist each get their own error and fix."""
    store = NodeStore(tmp_path / "store", fsync=False)
    with pytest.raises(HubRepoNotFound, match=r"acme/nothing was not found on .*check the name"):
        store.pull("hf://acme/nothing")
    with pytest.raises(HubRevisionNotFound, match=r"acme/public has no revision 'nope'.*@BRANCH"):
        store.pull("hf://acme/public@nope")


def test_private_repo_needs_a_token_with_access(
    env: pytest.MonkeyPatch, hub: HubServer, tmp_path: Path
) -> None:
    """Without a token the message says to set HF_TOKEN; with one that may not read it, says so; with access it pulls."""
    store = NodeStore(tmp_path / "store", fsync=False)
    with pytest.raises(HubRepoNotFound, match="no token was sent: set HF_TOKEN"):
        store.pull("hf://acme/private")
    env.setenv("HF_TOKEN", BOB)
    with pytest.raises(HubRepoNotFound, match=r"the token from \$HF_TOKEN may not read it") as bob:
        store.pull("hf://acme/private")
    env.setenv("HF_TOKEN", ALICE)
    res = store.pull("hf://acme/private")
    assert (res.snapshot / "w.safetensors").read_bytes() == b"p" * 4096
    assert all(auth == "-" for *_, auth in hub.requests("storage"))
    assert BOB not in str(bob.value) and ALICE not in _everything_written(tmp_path / "store")


def test_gated_repo_without_and_with_a_granted_token(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Gated: no token says to accept the conditions, a token without the grant says to request access."""
    store = NodeStore(tmp_path / "store", fsync=False)
    with pytest.raises(HubAccessDenied, match=r"gated model \(401 GatedRepo\); no token was sent"):
        store.pull("hf://acme/gated")
    env.setenv("HF_TOKEN", BOB)
    with pytest.raises(HubAccessDenied, match=r"403 GatedRepo.*has not been granted access") as e:
        store.pull("hf://acme/gated")
    assert BOB not in str(e.value)
    env.setenv("HF_TOKEN", ALICE)
    assert (store.pull("hf://acme/gated").snapshot / "config.json").read_bytes() == b'{"g": 1}'


def test_invalid_token_and_the_token_file(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A token the Hub does not know is refused as invalid (named by source, not value); $HF_HOME/token is read."""
    store = NodeStore(tmp_path / "store", fsync=False)
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "token").write_text("hf_not_a_real_token_42\n")
    with pytest.raises(
        HubAccessDenied, match=r"refused the token from the token file .*invalid"
    ) as e:
        store.pull("hf://acme/public")
    assert "hf_not_a_real_token_42" not in str(e.value)
    (home / "token").write_text(ALICE + "\n")
    assert store.pull("hf://acme/gated").bytes_fetched == len(b'{"g": 1}') + 4096
    env.setenv("HF_TOKEN_PATH", str(tmp_path / "elsewhere"))
    with pytest.raises(HubAccessDenied, match="no token was sent"):
        NodeStore(tmp_path / "store2", fsync=False).pull("hf://acme/gated")


def test_cli_error_is_one_line_without_the_token(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`preheat cache pull` of a gated repo with a token without the grant exits 1 with the fix and no token."""
    import subprocess
    import sys

    env.setenv("HF_TOKEN", BOB)
    out = subprocess.run(
        [
            str(Path(sys.executable).with_name("preheat")),
            "cache",
            "pull",
            "hf://acme/gated",
            "--store",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        check=False,
    )
    assert out.returncode == 1
    assert "HubAccessDenied" in out.stderr and "request it at" in out.stderr
    assert BOB not in out.stderr + out.stdout
