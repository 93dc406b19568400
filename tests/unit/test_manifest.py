"""Manifests and refs: parsing, digests and the path checks that keep a snapshot in its root."""

from __future__ import annotations

import hashlib
import json

import pytest

from preheat.artifacts.manifest import FileEntry, Manifest, check_relpath, revision_from_parts
from preheat.artifacts.refs import parse_ref
from preheat.errors import ConfigError, UnsafePath

A = hashlib.sha256(b"a").hexdigest()
B = hashlib.sha256(b"b").hexdigest()


def test_digest_is_order_independent_and_source_free() -> None:
    """The same files listed in any order give the same manifest digest."""
    m1 = Manifest((FileEntry("x/b.bin", 2, B), FileEntry("a.json", 1, A)))
    m2 = Manifest((FileEntry("a.json", 1, A), FileEntry("x/b.bin", 2, B)))
    assert m1.digest == m2.digest
    lines = f"{A} 1 a.json\n{B} 2 x/b.bin\n".encode()
    assert m1.digest == hashlib.sha256(lines).hexdigest()


def test_digest_changes_with_any_file() -> None:
    """Changing one file's digest, size or path changes the manifest digest."""
    base = Manifest((FileEntry("a", 1, A),))
    assert base.digest != Manifest((FileEntry("a", 1, B),)).digest
    assert base.digest != Manifest((FileEntry("a", 2, A),)).digest
    assert base.digest != Manifest((FileEntry("b", 1, A),)).digest


def test_json_round_trip() -> None:
    """to_json/from_json preserve every entry."""
    m = Manifest((FileEntry("a", 1, A), FileEntry("d/b", 2, B)))
    assert Manifest.from_json(m.to_json(revision="r1")) == m


def test_incomplete_manifest_has_no_digest_until_filled() -> None:
    """Unknown sha256s block the digest; with_digests fills them in."""
    m = Manifest((FileEntry("a", 1, None), FileEntry("b", 1, B)))
    assert not m.complete
    with pytest.raises(ValueError, match="missing"):
        _ = m.digest
    filled = m.with_digests({"a": A})
    assert filled.complete and filled.files[0].sha256 == A


@pytest.mark.parametrize(
    "path",
    [
        "../etc/passwd",
        "a/../../b",
        "/abs/file",
        "a//b",
        "./a",
        "a/./b",
        "",
        "a\\b",
        "C:/x",
        "a\x00b",
    ],
)
def test_unsafe_paths_rejected(path: str) -> None:
    """'..', absolute, empty, '.', backslash and NUL components are refused."""
    with pytest.raises(UnsafePath):
        check_relpath(path)


def test_manifest_rejects_traversal_from_json() -> None:
    """A manifest document naming '../x' fails to parse, naming the path."""
    doc = {"files": [{"path": "../x", "size": 1, "sha256": A}]}
    with pytest.raises(UnsafePath, match=r"\.\./x"):
        Manifest.from_json(json.dumps(doc))


def test_manifest_rejects_links() -> None:
    """Entries that declare a link are refused."""
    doc = {"files": [{"path": "w.bin", "size": 1, "sha256": A, "type": "symlink"}]}
    with pytest.raises(UnsafePath, match="link"):
        Manifest.from_dict(doc)


def test_manifest_rejects_file_used_as_directory_and_duplicates() -> None:
    """'a' as a file and 'a/b' cannot both exist; a path cannot repeat."""
    with pytest.raises(UnsafePath):
        Manifest((FileEntry("a", 1, A), FileEntry("a/b", 1, B)))
    with pytest.raises(ConfigError, match="twice"):
        Manifest((FileEntry("a", 1, A), FileEntry("a", 1, A)))


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ([], "JSON object"),
        ({"files": 3}, "list"),
        ({"files": [{"path": "a"}]}, "size"),
        ({"files": [{"path": "a", "size": "7"}]}, "integer"),
        ({"files": [{"path": "a", "size": -1}]}, ">= 0"),
        ({"files": [{"path": "a", "size": 1, "sha256": "xyz"}]}, "sha256"),
        ({"format": "other/v9", "files": []}, "format"),
    ],
)
def test_bad_manifest_documents(doc: object, match: str) -> None:
    """Each malformed document fails with a message naming the problem."""
    with pytest.raises(ConfigError, match=match):
        Manifest.from_dict(doc, where="m.json")


def test_not_json() -> None:
    """Garbage bytes are a ConfigError, not a JSONDecodeError."""
    with pytest.raises(ConfigError, match="not valid JSON"):
        Manifest.from_json(b"{nope")


def test_revision_from_parts_is_stable() -> None:
    """Origin metadata in any order gives the same revision id, prefixed by its kind."""
    r1 = revision_from_parts("s3-etag", [("k1", "e1", "1"), ("k2", "e2", "2")])
    r2 = revision_from_parts("s3-etag", [("k2", "e2", "2"), ("k1", "e1", "1")])
    assert r1 == r2 and r1.startswith("s3-etag:")
    assert r1 != revision_from_parts("s3-etag", [("k1", "e1b", "1"), ("k2", "e2", "2")])


def test_parse_refs() -> None:
    """Each supported scheme parses to its parts."""
    f = parse_ref("file:///models/llama/")
    assert (f.scheme, f.location) == ("file", "/models/llama")
    h = parse_ref("https://origin.example/m/preheat-manifest.json")
    assert h.scheme == "https" and h.is_manifest_url
    assert not parse_ref("http://h/m/model.safetensors").is_manifest_url
    s = parse_ref("s3://my-bucket/models/llama")
    assert (s.bucket, s.location) == ("my-bucket", "models/llama")
    assert f.key != parse_ref("file:///models/llama2").key


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("ftp://x/y", "unsupported scheme"),
        ("/models/llama", "unsupported scheme"),
        ("file://host/x", "three slashes"),
        ("https:///x.json", "no host"),
        ("https://h/dir/", "directory"),
        ("s3://Bad_Bucket/x", "bucket name"),
    ],
)
def test_bad_refs(text: str, match: str) -> None:
    """Bad refs fail with a message that names the value and shows the valid forms."""
    with pytest.raises(ConfigError, match=match):
        parse_ref(text)


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("a" * 256, "a" * 40),
        ("ok/" + "é" * 128 + "/x", "é" * 40),
        ("d/" * 2048 + "x", "4097 bytes"),
    ],
)
def test_names_too_long_for_a_filesystem_are_refused(path: str, named: str) -> None:
    """A component over 255 bytes (UTF-8) or a path over 4095 bytes is UnsafePath naming it."""
    with pytest.raises(UnsafePath, match=named):
        Manifest.from_dict({"files": [{"path": path, "size": 1}]})
    FileEntry("b" * 255, 1)  # exactly 255 bytes is fine
