"""hf:// refs, filters, token discovery and the Hub's error codes (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.artifacts.refs import hf_patterns, parse_ref
from preheat.errors import (
    ConfigError,
    HubAccessDenied,
    HubRepoNotFound,
    HubRevisionNotFound,
    ObjectNotFound,
    OriginUnavailable,
)
from preheat.sources.base import source_identity
from preheat.sources.hf import selected
from preheat.sources.hf_api import Token, find_token, hub_endpoint, hub_error


def test_parse_hf_refs() -> None:
    """Repo id and revision (main by default, slashes allowed) are parsed; the key keeps no '#' or '*'."""
    r = parse_ref("hf://Qwen/Qwen2.5-0.5B-Instruct")
    assert (r.scheme, r.bucket, r.location) == ("hf", "Qwen/Qwen2.5-0.5B-Instruct", "main")
    r = parse_ref("hf://acme/tiny@refs/pr/1#include=*.json")
    assert (r.bucket, r.location) == ("acme/tiny", "refs/pr/1")
    assert r.display == "hf://acme/tiny@refs/pr/1#include=*.json"
    assert "*" not in r.key and "#" not in r.key


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("hf://gpt2", "not a Hub repo id"),
        ("hf://a/b/c", "not a Hub repo id"),
        ("hf://acme/bad--name", "not a Hub repo id"),
        ("hf://acme/tiny@", "revision ''"),
        ("hf://acme/tiny#only=*.json", "not a file filter"),
        ("hf://acme/tiny#include=", "not a file filter"),
    ],
)
def test_bad_hf_refs_name_the_fix(text: str, says: str) -> None:
    """Each malformed hf:// ref is refused with what is wrong and a valid form."""
    with pytest.raises(ConfigError, match=says):
        parse_ref(text)


def test_patterns_and_selection_match_huggingface_cli() -> None:
    """include narrows, exclude removes, 'dir/' means everything under it, values are percent-decoded."""
    inc, exc = hf_patterns("include=*.safetensors&include=*.json&exclude=original/&exclude=a%26b")
    assert inc == ("*.safetensors", "*.json") and exc == ("original/", "a&b")
    assert selected("model.safetensors", inc, exc)
    assert not selected("original/model.safetensors", inc, exc)
    assert not selected("README.md", inc, exc)
    assert selected("README.md", (), ())


def test_token_discovery_order(tmp_path: Path) -> None:
    """HF_TOKEN wins, then the legacy variable, then HF_TOKEN_PATH, then $HF_HOME/token; str() shows only the source."""
    (tmp_path / "token").write_text("hf_file\n")
    (tmp_path / "other").write_text("hf_other\n")
    home = {"HF_HOME": str(tmp_path)}
    assert find_token({**home, "HF_TOKEN": "hf_env"}) == Token("hf_env", "$HF_TOKEN")
    assert find_token({**home, "HUGGING_FACE_HUB_TOKEN": "hf_old"}).value == "hf_old"  # type: ignore[union-attr]
    assert find_token({**home, "HF_TOKEN_PATH": str(tmp_path / "other")}).value == "hf_other"  # type: ignore[union-attr]
    tok = find_token(home)
    assert tok is not None and tok.value == "hf_file"
    assert "hf_file" not in f"{tok} {tok!r}"
    assert find_token({"HF_HOME": str(tmp_path / "none")}) is None


def test_endpoint_and_source_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub is --endpoint-url, else HF_ENDPOINT, else huggingface.co; resolutions are keyed by it."""
    assert hub_endpoint(None, {}) == "https://huggingface.co"
    assert hub_endpoint(None, {"HF_ENDPOINT": "http://mirror:8080/"}) == "http://mirror:8080"
    assert hub_endpoint("http://x", {"HF_ENDPOINT": "http://mirror"}) == "http://x"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert source_identity(parse_ref("hf://acme/tiny")) == "hf://acme/tiny @ http://127.0.0.1:9"


def test_error_codes_map_to_errors_with_fixes() -> None:
    """X-Error-Code picks the error; the message says what to do and shows the token's source only."""
    tok = Token("hf_secret_value", "$HF_TOKEN")
    kw = {"endpoint": "http://hub", "repo": "acme/m", "rev": "main"}
    assert hub_error(200, {}, token=None, **kw) is None
    e = hub_error(401, {"X-Error-Code": "RepoNotFound"}, token=None, **kw)
    assert isinstance(e, HubRepoNotFound) and "set HF_TOKEN" in str(e)
    e = hub_error(404, {"X-Error-Code": "RevisionNotFound"}, token=tok, **kw)
    assert isinstance(e, HubRevisionNotFound)
    e = hub_error(403, {"X-Error-Code": "GatedRepo"}, token=tok, **kw)
    assert isinstance(e, HubAccessDenied) and "http://hub/acme/m" in str(e)
    e = hub_error(
        401, {"X-Error-Message": "Invalid credentials in Authorization header"}, token=tok, **kw
    )
    assert isinstance(e, HubAccessDenied) and "$HF_TOKEN" in str(e) and "hf_secret" not in str(e)
    assert isinstance(
        hub_error(404, {"X-Error-Code": "EntryNotFound"}, token=tok, **kw), ObjectNotFound
    )
    assert isinstance(hub_error(503, {}, token=tok, **kw), OriginUnavailable)


def test_endpoint_url_applies_to_hf_and_filters_only_to_hf(tmp_path: Path) -> None:
    """--endpoint-url picks the Hub for hf://; --include on a non-hf source is refused with the reason."""
    from click.testing import CliRunner

    from preheat.cli.cache import cache
    from preheat.sources.base import open_source

    src = open_source("hf://acme/tiny", endpoint_url="http://127.0.0.1:9/")
    assert src.endpoint == "http://127.0.0.1:9"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="only applies to s3:// and hf://"):
        open_source("file:///tmp", endpoint_url="http://x")
    out = CliRunner().invoke(
        cache, ["pull", "file:///tmp", "--store", str(tmp_path), "--include", "*.json"]
    )
    assert out.exit_code == 1 and "only apply to hf:// sources" in out.output
