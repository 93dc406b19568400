"""The node image cache against a real distribution registry (pushed with skopeo)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.errors import ImageInUse, RegistryAuthError, UnsupportedMediaType
from preheat.images import ImageCache, parse_platform
from preheat.store import NodeStore
from preheat.testing.registry import Registry, registry, skopeo, token_registry, write_layout

MiB = 1 << 20


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    base = tmp_path_factory.mktemp("registry")
    app = write_layout(base / "app", [3 * MiB, 1 * MiB], platforms=("linux/amd64", "linux/arm64"))
    other = write_layout(base / "other", [3 * MiB, 1 * MiB, 2 * MiB])  # shares 2 layers
    with registry(base / "reg") as r:
        r.push(app.path, "team/app:v1")
        r.push(other.path, "team/other:v2")
        r.layouts = {"app": app, "other": other}  # type: ignore[attr-defined]
        yield r


def test_layers_are_stored_once_across_images(reg: Registry, tmp_path: Path) -> None:
    """A second image that shares layers fetches only its own; a repeat pull fetches nothing."""
    cache = ImageCache(NodeStore(tmp_path / "s"))
    first = cache.pull(reg.ref("team/app:v1"), platform=parse_platform("linux/amd64"))
    app = reg.layouts["app"].images["linux/amd64"]  # type: ignore[attr-defined]
    assert first.digest == app.manifest and first.layers == 2
    assert first.bytes_fetched >= app.size and first.bytes_reused == 0
    shared = [d for d, _ in app.layers]
    before = len(reg.requests())
    second = cache.pull(reg.ref("team/other:v2"))
    new_requests = reg.requests()[before:]
    assert second.bytes_reused >= app.size  # both shared layers came from the store
    assert not [r for r in new_requests if any(d in r and r.startswith("GET") for d in shared)]
    again = cache.pull(reg.ref("team/app:v1"), platform=parse_platform("linux/amd64"))
    assert again.digest == first.digest and again.bytes_fetched == 0
    # every layer file in two views is one inode
    for d in shared:
        hexd = d.removeprefix("sha256:")
        a = (first.view / "blobs" / "sha256" / hexd).stat()
        b = (second.view / "blobs" / "sha256" / hexd).stat()
        assert a.st_ino == b.st_ino


def test_index_platform_selection(reg: Registry, tmp_path: Path) -> None:
    """--platform picks that manifest from the image index; a missing one is named."""
    cache = ImageCache(NodeStore(tmp_path / "s"))
    arm = cache.pull(reg.ref("team/app:v1"), platform=parse_platform("linux/arm64"))
    assert arm.digest == reg.layouts["app"].images["linux/arm64"].manifest  # type: ignore[attr-defined]
    assert arm.platform == "linux/arm64" and arm.top_digest != arm.digest
    with pytest.raises(
        UnsupportedMediaType, match=r"no image for platform linux/s390x .*linux/amd64"
    ):
        cache.pull(reg.ref("team/app:v1"), platform=parse_platform("linux/s390x"))


def test_view_is_an_oci_layout_skopeo_imports(reg: Registry, tmp_path: Path) -> None:
    """skopeo copies the cached view as an OCI layout, byte-identical blobs included."""
    cache = ImageCache(NodeStore(tmp_path / "s"))
    pulled = cache.pull(reg.ref("team/other:v2"))
    skopeo("copy", f"oci:{pulled.view}", f"oci:{tmp_path / 'out'}:x")
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["manifests"][0]["digest"] == pulled.digest
    got = {p.name for p in (tmp_path / "out" / "blobs" / "sha256").iterdir()}
    assert got == {p.name for p in (pulled.view / "blobs" / "sha256").iterdir()}


def test_digest_ref_held_needs_no_registry(reg: Registry, tmp_path: Path) -> None:
    """An image pulled once is served for REPO@DIGEST without asking the registry."""
    cache = ImageCache(NodeStore(tmp_path / "s"))
    first = cache.pull(reg.ref("team/other:v2"))
    before = len(reg.requests())
    again = cache.pull(reg.ref(f"team/other@{first.digest}"))
    assert again.digest == first.digest and again.bytes_fetched == 0
    assert len(reg.requests()) == before


def test_references_protect_and_the_last_one_cleans_up(reg: Registry, tmp_path: Path) -> None:
    """A referenced image survives eviction and rm; dropping the last reference removes it."""
    store = NodeStore(tmp_path / "s")
    cache = ImageCache(store)
    used = cache.pull(reg.ref("team/app:v1"), platform=parse_platform("linux/amd64"))
    spare = cache.pull(reg.ref("team/app:v1"), platform=parse_platform("linux/arm64"))
    cache.ref(used.digest, "chat")
    cache.ref(used.digest, "summarise")
    plan = store.plan_eviction(1 << 40)  # everything evictable
    store.execute(plan)
    assert [i.digest for i in cache.images()] == [used.digest]
    assert spare.digest not in {i.digest for i in cache.images()}
    with pytest.raises(ImageInUse, match="chat, summarise"):
        cache.rm(used.digest)
    assert cache.unref(used.digest, "chat") is False
    assert cache.find(used.digest).references == ("summarise",)
    assert cache.unref(used.digest, "summarise") is True
    assert cache.images() == [] and not used.view.exists()
    assert store.usage().used == 0


def test_bearer_token_flow_with_docker_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials from DOCKER_CONFIG go to the token service; wrong ones are refused
    without the password in the message."""
    layout = write_layout(tmp_path / "img", [MiB])
    with token_registry(tmp_path / "reg", users={"bob": "hunter2-secret"}) as (reg, issuer):
        reg.push(layout.path, "private/app:v1")
        cfg = tmp_path / "docker"
        cfg.mkdir()
        auth = {"auths": {reg.host: {"username": "bob", "password": "hunter2-secret"}}}
        (cfg / "config.json").write_text(json.dumps(auth))
        monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
        issued = issuer.issued
        pulled = ImageCache(NodeStore(tmp_path / "s")).pull(reg.ref("private/app:v1"))
        assert pulled.digest == layout.digest and issuer.issued > issued
        auth["auths"][reg.host]["password"] = "wrong-password"
        (cfg / "config.json").write_text(json.dumps(auth))
        with pytest.raises(RegistryAuthError) as err:
            ImageCache(NodeStore(tmp_path / "s2")).pull(reg.ref("private/app:v1"))
        assert "wrong-password" not in str(err.value) and reg.host in str(err.value)


def test_cli_pull_ls_rm_json(reg: Registry, tmp_path: Path) -> None:
    """`preheat image pull|ls|rm --json` report the digest, bytes and layers."""
    runner = CliRunner()
    store = str(tmp_path / "s")
    out = runner.invoke(
        main, ["image", "pull", reg.ref("team/other:v2"), "--store", store, "--json"]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert {"digest", "bytes_fetched", "bytes_reused", "layers", "seconds"} <= doc.keys()
    assert doc["layers"] == 3 and doc["bytes_fetched"] > 6 * MiB
    listed = json.loads(runner.invoke(main, ["image", "ls", "--store", store, "--json"]).output)
    assert [i["digest"] for i in listed] == [doc["digest"]]
    gone = runner.invoke(main, ["image", "rm", doc["digest"], "--store", store])
    assert gone.exit_code == 0, gone.output
    assert json.loads(runner.invoke(main, ["image", "ls", "--store", store, "--json"]).output) == []
    assert not os.listdir(tmp_path / "s" / "snapshots")


def test_basic_auth_challenge(reg: Registry, tmp_path: Path) -> None:
    """A registry that answers `WWW-Authenticate: Basic` gets the config.json credentials
    (here a Basic-auth front of the real registry, the way an nginx front would do it)."""
    import base64

    import aiohttp
    from aiohttp import web

    from preheat.testing.origins import AppInThread

    want = "Basic " + base64.b64encode(b"carol:pa55").decode()
    seen: list[str] = []

    async def front(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != want:
            return web.Response(status=401, headers={"WWW-Authenticate": 'Basic realm="r"'})
        headers = {k: v for k, v in request.headers.items() if k in ("Accept", "Range")}
        async with (
            aiohttp.ClientSession() as s,
            s.request(request.method, f"{reg.url}{request.path_qs}", headers=headers) as up,
        ):
            body = await up.read()
            keep = ("Content-Type", "Docker-Content-Digest", "Content-Range")
            return web.Response(
                status=up.status,
                body=body,
                headers={k: up.headers[k] for k in keep if k in up.headers},
            )

    with AppInThread(front) as app:
        cfg = tmp_path / "config.json"
        cfg.write_text(
            json.dumps(
                {
                    "auths": {
                        f"127.0.0.1:{app.port}": {"auth": base64.b64encode(b"carol:pa55").decode()}
                    }
                }
            )
        )
        cache = ImageCache(NodeStore(tmp_path / "s"), docker_config=cfg)
        pulled = cache.pull(f"127.0.0.1:{app.port}/team/other:v2")
        assert pulled.layers == 3 and seen[0] == "" and want in seen
        cfg.write_text(json.dumps({"auths": {}}))
        with pytest.raises(RegistryAuthError, match="Basic"):
            ImageCache(NodeStore(tmp_path / "s2"), docker_config=cfg).pull(
                f"127.0.0.1:{app.port}/team/other:v2"
            )


def test_schema_2_store_migrates_to_3_keeping_its_rows(tmp_path: Path) -> None:
    """A store written before the image tables opens with them added and its revisions kept."""
    import sqlite3

    src = tmp_path / "m"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 100)
    store = NodeStore(tmp_path / "s")
    first = store.pull(f"file://{src}")
    con = sqlite3.connect(store.layout.db)
    con.execute("DROP TABLE images")
    con.execute("DROP TABLE revoked")
    con.execute("UPDATE revisions SET label='main'")  # a v2 column the v0 migration drops
    con.execute("PRAGMA user_version=2")
    con.commit()
    con.close()
    again = NodeStore(tmp_path / "s")
    assert again.snapshots()[0].labels == ("main",)  # not re-keyed as a version-0 store
    assert again.snapshots()[0].refs == (f"file://{src}",)
    assert ImageCache(again).images() == []
    con = sqlite3.connect(store.layout.db)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 3
    assert con.execute("SELECT label FROM revisions").fetchall() == [("main",)]
    con.close()
    assert first.manifest_digest == again.snapshots()[0].digest
