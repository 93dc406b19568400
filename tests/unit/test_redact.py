"""URL credentials never survive into text meant for people, logs or labels."""

from __future__ import annotations

from preheat.artifacts.refs import REDACTED, parse_ref, redact_url


def test_userinfo_is_redacted() -> None:
    """user:password in a URL is replaced, host and path are kept."""
    out = redact_url("https://alice:s3cr3t@origin.example/models/m/preheat-manifest.json")
    assert "s3cr3t" not in out and "alice" not in out
    assert out == f"https://{REDACTED}@origin.example/models/m/preheat-manifest.json"


def test_presigned_query_is_redacted_inside_a_message() -> None:
    """A presigned query string inside an error message is dropped, the rest kept."""
    msg = (
        "GET https://b.s3.example/w.bin?X-Amz-Signature=abc123&X-Amz-Credential=AKIAX "
        "failed: 403; retried http://127.0.0.1:9/x?token=zzz#frag"
    )
    out = redact_url(msg)
    assert "abc123" not in out and "AKIAX" not in out and "zzz" not in out
    assert f"https://b.s3.example/w.bin?{REDACTED} failed: 403" in out
    assert out.endswith(f"http://127.0.0.1:9/x?{REDACTED}#frag")


def test_plain_text_and_clean_urls_unchanged() -> None:
    """Text without a URL credential is returned unchanged."""
    for s in ("no url here", "file:///models/llama", "s3://bucket/prefix/a.bin"):
        assert redact_url(s) == s


def test_ref_key_and_display_carry_no_secret() -> None:
    """The refs/ directory name and the display form hold no credential; keys stay distinct."""
    a = parse_ref("https://u:topsecret@h.example/m/preheat-manifest.json?sig=qqq")
    b = parse_ref("https://u:other@h.example/m/preheat-manifest.json?sig=rrr")
    for r in (a, b):
        assert "topsecret" not in r.key and "qqq" not in r.key and "other" not in r.key
        assert "topsecret" not in r.display and "qqq" not in r.display
    assert a.key != b.key


def test_presigned_manifest_url_is_still_a_manifest() -> None:
    """A manifest URL with a signature in its query string is read as a manifest."""
    r = parse_ref("https://h.example/m/preheat-manifest.json?X-Amz-Signature=abc")
    assert r.is_manifest_url
    assert not parse_ref("https://h.example/m/model.bin?name=preheat-manifest.json").is_manifest_url
