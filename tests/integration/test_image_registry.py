"""The test registry itself: a real distribution registry, pushed to with skopeo."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from preheat.testing.registry import registry, token_registry, write_layout


def test_push_single_platform_keeps_manifest_digest(tmp_path: Path) -> None:
    """A pushed single-platform layout is served under its manifest digest, and the access
    log counts the requests."""
    layout = write_layout(tmp_path / "img", [64 << 10, 1000])
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/app:v1")
        req = urllib.request.Request(
            f"{reg.url}/v2/team/app/manifests/v1",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Docker-Content-Digest"] == layout.digest
            body = json.loads(resp.read())
        assert [x["digest"] for x in body["layers"]] == [
            d for d, _ in layout.images["linux/amd64"].layers
        ]
        assert reg.requests("GET /v2/team/app/manifests/v1")


def test_token_registry_challenges_with_bearer(tmp_path: Path) -> None:
    """The token-auth registry answers 401 with a Bearer challenge naming the issuer."""
    layout = write_layout(tmp_path / "img", [1000])
    with token_registry(tmp_path / "reg") as (reg, issuer):
        reg.push(layout.path, "team/app:v1")  # skopeo went through the issuer
        assert issuer.issued >= 1
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{reg.url}/v2/team/app/manifests/v1", timeout=10)
        assert err.value.code == 401
        challenge = err.value.headers["WWW-Authenticate"]
        assert challenge.startswith(f'Bearer realm="{issuer.realm}"')
        assert 'scope="repository:team/app:pull"' in challenge
        err.value.close()
