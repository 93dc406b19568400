"""Image references, platforms, auth challenges, docker config and manifest checks (pure)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from preheat.errors import ConfigError, UnsupportedMediaType
from preheat.images.auth import config_path, load_credentials, parse_challenge
from preheat.images.manifest import Descriptor, choose_platform, layout_index, parse_manifest
from preheat.images.reference import node_platform, parse_image_ref, parse_platform

D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("text", "registry", "repo", "tag", "digest"),
    [
        ("127.0.0.1:5000/team/app:v1", "127.0.0.1:5000", "team/app", "v1", None),
        ("localhost/app", "localhost", "app", "latest", None),
        ("ubuntu", "docker.io", "library/ubuntu", "latest", None),
        ("org/app:1.2", "docker.io", "org/app", "1.2", None),
        (f"reg.example/a/b@{D}", "reg.example", "a/b", None, D),
        (f"docker://reg.example:443/a:t@{D}", "reg.example:443", "a", "t", D),
    ],
)
def test_parse_image_ref(
    text: str, registry: str, repo: str, tag: str | None, digest: str | None
) -> None:
    """References split into registry, repository, tag and digest as docker reads them."""
    r = parse_image_ref(text)
    assert (r.registry, r.repository, r.tag, r.digest) == (registry, repo, tag, digest)
    assert r.reference == (digest or tag)


def test_plain_http_only_for_loopback() -> None:
    """127.0.0.0/8 and localhost registries are plain HTTP; every other one is HTTPS."""
    assert parse_image_ref("127.0.0.1:5000/a").base_url == "http://127.0.0.1:5000/v2"
    assert parse_image_ref("localhost:5000/a").plain_http
    assert parse_image_ref("reg.example/a").base_url == "https://reg.example/v2"
    assert parse_image_ref("127.example/a").base_url.startswith("https://")
    assert parse_image_ref("ubuntu").base_url == "https://registry-1.docker.io/v2"


@pytest.mark.parametrize(
    ("text", "bad"),
    [("", "empty"), ("Reg.example/UPPER", "UPPER"), ("a/b:-x", "-x"), ("a@sha256:12", "sha256:12")],
)
def test_bad_refs_are_named(text: str, bad: str) -> None:
    """A bad reference names the part that is wrong."""
    with pytest.raises(ConfigError, match=bad):
        parse_image_ref(text)


def test_platforms() -> None:
    """Platforms parse, the node's is derived from uname, and variants match loosely."""
    assert parse_platform("linux/arm64/v8").variant == "v8"
    assert node_platform("Linux", "x86_64").text == "linux/amd64"
    assert node_platform("Linux", "aarch64").text == "linux/arm64"
    assert parse_platform("linux/arm64").matches(
        {"os": "linux", "architecture": "arm64", "variant": "v8"}
    )
    with pytest.raises(ConfigError, match="linux"):
        parse_platform("linux")


def test_parse_challenge() -> None:
    """Bearer and Basic challenges parse with quoted, comma-separated parameters."""
    ch = parse_challenge(
        'Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull,push"'
    )
    assert ch is not None and ch.scheme == "bearer"
    assert ch.params == {
        "realm": "https://auth.example/token",
        "service": "reg",
        "scope": "repository:a/b:pull,push",
    }
    basic = parse_challenge('Basic realm="Registry Realm"')
    assert basic is not None and basic.scheme == "basic"
    assert parse_challenge("Negotiate abc") is None


def test_docker_config_credentials(tmp_path: Path) -> None:
    """auth, username/password and identitytoken entries are read; keys may be URLs."""
    cfg = tmp_path / "config.json"
    auths = {
        "https://reg.example/v1/": {"auth": base64.b64encode(b"u:p:w").decode()},
        "other.example:5000": {"username": "x", "password": "y"},
        "https://index.docker.io/v1/": {"identitytoken": "tok"},
    }
    cfg.write_text(json.dumps({"auths": auths}))
    a = load_credentials("reg.example", cfg)
    assert a is not None and (a.username, a.password) == ("u", "p:w")
    assert "p:w" not in repr(a)
    b = load_credentials("other.example:5000", cfg)
    assert b is not None and b.password == "y"
    hub = load_credentials("docker.io", cfg)
    assert hub is not None and hub.identity_token == "tok"
    assert load_credentials("nobody.example", cfg) is None
    assert load_credentials("x", tmp_path / "missing.json") is None
    assert config_path({"DOCKER_CONFIG": "/d"}) == Path("/d/config.json")
    assert config_path({"HOME": "/h"}) == Path("/h/.docker/config.json")


def test_manifest_checks_name_the_media_type() -> None:
    """Schema-1, foreign layers and non-image configs are refused by name."""
    desc = Descriptor("application/vnd.oci.image.manifest.v1+json", D, 10)
    good_cfg = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": D, "size": 2}
    layer = {
        "mediaType": "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
        "digest": D,
        "size": 3,
    }
    with pytest.raises(UnsupportedMediaType, match="foreign"):
        parse_manifest({"config": good_cfg, "layers": [layer]}, desc, "x")
    v1 = Descriptor("application/vnd.docker.distribution.manifest.v1+prettyjws", D, 10)
    with pytest.raises(UnsupportedMediaType, match=r"v1\+prettyjws"):
        parse_manifest({}, v1, "x")
    cfg = {**good_cfg, "mediaType": "application/vnd.cncf.model.config.v1+json"}
    with pytest.raises(UnsupportedMediaType, match=r"cncf\.model\.config"):
        parse_manifest({"config": cfg, "layers": []}, desc, "x")
    with pytest.raises(UnsupportedMediaType, match="sha512"):
        parse_manifest({"config": {**good_cfg, "digest": "sha512:ab"}, "layers": []}, desc, "x")


def test_index_choice_and_layout_index() -> None:
    """The platform's entry is chosen; the layout index is deterministic."""
    index = {
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": D,
                "size": 5,
                "platform": {"os": "linux", "architecture": "amd64"},
            },
        ]
    }
    d = choose_platform(index, parse_platform("linux/amd64"), "x")
    assert d.digest == D
    cfg = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": D, "size": 2}
    img = parse_manifest({"config": cfg, "layers": []}, d, "x")
    assert layout_index(img, None) == layout_index(img, None)
    assert (
        json.loads(layout_index(img, parse_platform("linux/amd64")))["manifests"][0]["platform"][
            "os"
        ]
        == "linux"
    )
