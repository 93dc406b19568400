"""Docker credential helpers (`credsStore`, `credHelpers`) against the real token-auth
registry, with a helper script on PATH written by the test."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.errors import CredentialHelperError, RegistryAuthError
from preheat.images.cache import ImageCache
from preheat.store.store import NodeStore
from preheat.testing.registry import Registry, token_registry, write_layout

USER, SECRET = "carol", "helper-secret-42"


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    base = tmp_path_factory.mktemp("treg")
    with token_registry(base / "reg", users={USER: SECRET}) as (r, _issuer):
        r.push(write_layout(base / "img", [2000]).path, "private/app:v1")
        yield r


def _helper(bin_dir: Path, name: str, script: str) -> Path:
    """A `docker-credential-NAME` that logs its argv and stdin, then runs ``script``."""
    bin_dir.mkdir(exist_ok=True)
    log = bin_dir / f"{name}.log"
    exe = bin_dir / f"docker-credential-{name}"
    exe.write_text(
        f'#!/bin/sh\nprintf "%s %s\\n" "$1" "$(cat)" >> {log}\n{script}\n', encoding="utf-8"
    )
    exe.chmod(0o755)
    return log


def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, doc: dict[str, object]) -> None:
    cfg = tmp_path / "docker"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(doc))
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")


def test_credential_helpers_supply_the_registry_credentials(
    reg: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`credHelpers.<host>` wins over `credsStore` and `auths`: its helper gets `get` with
    the registry host on stdin and its Username/Secret pass the token flow."""
    answer = json.dumps({"ServerURL": reg.host, "Username": USER, "Secret": SECRET})
    log = _helper(tmp_path / "bin", "preheattest", f"echo '{answer}'")
    _config(
        tmp_path,
        monkeypatch,
        {
            "credsStore": "not-installed",
            "credHelpers": {reg.host: "preheattest"},
            "auths": {reg.host: {"username": USER, "password": "wrong"}},
        },
    )
    pulled = ImageCache(NodeStore(tmp_path / "s")).pull(reg.ref("private/app:v1"))
    assert pulled.layers == 1
    assert log.read_text().splitlines()[0] == f"get {reg.host}"


@pytest.mark.parametrize(
    ("script", "error", "match"),
    [
        (None, CredentialHelperError, "docker-credential-preheatgone is not on PATH"),
        (
            "echo 'credentials not found in native keychain'; exit 1",
            RegistryAuthError,
            "refused the credentials",
        ),
        ("echo 'the keychain is locked' >&2; exit 3", CredentialHelperError, "exited 3.*locked"),
    ],
    ids=["missing", "not-found-is-anonymous", "failing"],
)
def test_credential_helper_failures_are_named(
    reg: Registry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    script: str | None,
    error: type[Exception],
    match: str,
) -> None:
    """A missing or failing helper is an error naming it; "not found" pulls anonymously
    (which this registry denies), and no secret ever appears in the message."""
    name = "preheatgone" if script is None else "preheatfail"
    if script is not None:
        _helper(tmp_path / "bin", name, script)
    else:
        (tmp_path / "bin").mkdir()
    _config(tmp_path, monkeypatch, {"credsStore": name})
    with pytest.raises(error, match=match) as err:
        ImageCache(NodeStore(tmp_path / "s")).pull(reg.ref("private/app:v1"))
    assert SECRET not in str(err.value)
