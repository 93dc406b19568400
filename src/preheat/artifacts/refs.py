"""Artifact references: what a user writes to name a model (pure: no I/O).

Supported schemes::

    file:///abs/path/dir           a directory tree on this machine (or one file)
    http(s)://host/.../preheat-manifest.json   a JSON manifest naming files relative to it
    http(s)://host/.../file.bin    a single file
    s3://bucket/prefix             every object under the prefix
    hf://ORG/NAME[@REVISION]       a Hugging Face Hub model at a branch, tag or commit
                                   (default main); ``#include=GLOB&exclude=GLOB`` filters
    oci://registry/repo:tag        a CNCF ModelPack artifact in an OCI registry (or
    oci://registry/repo@sha256:…)  pinned by digest); see docs/images.md

A ref is mutable (the bytes behind it can change); ``pull`` resolves it to an immutable
``Revision`` every time, and the store is keyed by what it resolved to.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from preheat.errors import ConfigError

SCHEMES = ("file", "http", "https", "s3", "hf", "oci")
MANIFEST_NAME = "preheat-manifest.json"
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<netloc>[^/?#]*)(?P<path>[^?#]*)")


_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s]*@")
REDACTED = "REDACTED"


def redact_url(text: str) -> str:
    """``text`` with every URL credential replaced by ``REDACTED``.

    Userinfo (``https://user:pass@host``) and whole query strings (presigned S3/GCS URLs
    carry their signature and token there) are secrets; scheme, host and path are kept so
    the message still says which origin failed. Works on any string (an error message
    that embeds URLs), not only on a bare ref.
    """
    if "://" not in text:
        return text
    out = _USERINFO.sub(lambda m: f"{m.group('head')}{REDACTED}@", text)
    if "?" not in out:
        return out
    return _redact_queries(out)


def _redact_queries(text: str) -> str:
    parts: list[str] = []
    pos = 0
    for m in re.finditer(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*", text):
        parts.append(text[pos : m.start()])
        url = m.group(0)
        q = url.find("?")
        if q >= 0:
            frag = url.find("#", q)
            url = url[:q] + f"?{REDACTED}" + (url[frag:] if frag >= 0 else "")
        parts.append(url)
        pos = m.end()
    parts.append(text[pos:])
    return "".join(parts)


def _unquote(path: str) -> str:
    return re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), path)


@dataclass(frozen=True)
class ArtifactRef:
    """A parsed reference. ``location`` is the path (file), URL (http) or prefix (s3)."""

    text: str
    scheme: str
    bucket: str = ""
    location: str = ""

    @property
    def key(self) -> str:
        """A filesystem-safe, collision-free name for this ref (used under ``refs/``).

        The readable part is taken from the redacted text, so no credential of the URL
        (userinfo, a presigned query string) ever becomes a directory name; the hash is
        over the full text, so two refs that differ only in credentials stay distinct.
        """
        shown = redact_url(self.text).split("://", 1)[-1]
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", shown).strip("_")
        digest = hashlib.sha256(self.text.encode()).hexdigest()[:16]
        return f"{self.scheme}_{readable[:80]}_{digest}"

    @property
    def display(self) -> str:
        """The ref as it may appear in a message, log line, label or event: no secrets."""
        return redact_url(self.text)

    @property
    def is_manifest_url(self) -> bool:
        # the name of the path, not of a query string (a presigned manifest URL ends in one)
        path = re.split(r"[?#]", self.location, maxsplit=1)[0]
        return self.scheme in ("http", "https") and path.rsplit("/", 1)[-1].endswith(MANIFEST_NAME)


def parse_ref(text: str) -> ArtifactRef:
    """Parse and validate a ref; the error names the bad value and shows valid forms."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"artifact ref {text!r} is empty; write e.g. file:///models/llama")
    text = text.strip()
    m = _URL.match(text)
    raw_scheme = m.group("scheme") if m else ""
    scheme = raw_scheme.lower()
    if m is None or scheme not in SCHEMES:
        raise ConfigError(
            f"artifact ref {text!r} has unsupported scheme {raw_scheme!r}; use one of "
            "file:///abs/dir, https://host/path/preheat-manifest.json, s3://bucket/prefix, "
            "hf://ORG/NAME[@REVISION], oci://registry/repo:tag"
        )
    if scheme == "hf":
        return _parse_hf(text)
    if scheme == "oci":
        if not text[len("oci://") :].strip("/"):
            raise ConfigError(
                f"artifact ref {text!r} names no image; write oci://registry/repo:tag"
            )
        return ArtifactRef(text=text, scheme="oci", location=text[len("oci://") :])
    netloc, path = m.group("netloc"), m.group("path")
    if scheme == "file":
        if netloc not in ("", "localhost"):
            raise ConfigError(
                f"artifact ref {text!r} names host {netloc!r}; file refs are local: "
                "write file:///abs/path (three slashes)"
            )
        path = _unquote(path)
        if not path.startswith("/"):
            raise ConfigError(f"artifact ref {text!r} must be an absolute path: file:///abs/path")
        return ArtifactRef(text=text, scheme="file", location=path.rstrip("/") or "/")
    if scheme in ("http", "https"):
        if not netloc:
            raise ConfigError(f"artifact ref {text!r} has no host; write https://host/path")
        if not path or path.endswith("/"):
            raise ConfigError(
                f"artifact ref {text!r} names a directory; point it at a file or at "
                f"{MANIFEST_NAME} (write one with `preheat cache manifest DIR`)"
            )
        return ArtifactRef(text=text, scheme=scheme, location=text)
    bucket = netloc
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise ConfigError(
            f"artifact ref {text!r}: {bucket!r} is not a valid S3 bucket name "
            "(3-63 lowercase letters, digits, '.', '-')"
        )
    prefix = path.lstrip("/")
    return ArtifactRef(text=text, scheme="s3", bucket=bucket, location=prefix)


# --- hf:// -------------------------------------------------------------------------------

_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HF_KEYS = ("include", "exclude")


def _parse_hf(text: str) -> ArtifactRef:
    """``hf://ORG/NAME[@REVISION][#include=GLOB&exclude=GLOB...]``: ``bucket`` is the repo id,
    ``location`` the revision (``main`` by default)."""
    body, _, fragment = text[len("hf://") :].partition("#")
    repo, at, revision = body.partition("@")
    parts = repo.split("/")
    if (
        len(parts) != 2
        or not all(_HF_PART.match(p) for p in parts)
        or any(s in repo for s in ("--", ".."))
        or len(repo) > 96
    ):
        raise ConfigError(
            f"artifact ref {text!r}: {repo!r} is not a Hub repo id; write hf://ORG/NAME, e.g. "
            "hf://Qwen/Qwen2.5-0.5B-Instruct (a model without an org is under one now, e.g. "
            "hf://openai-community/gpt2)"
        )
    if at and (not revision or any(ord(c) <= 32 for c in revision)):
        raise ConfigError(
            f"artifact ref {text!r}: revision {revision!r} is empty or has spaces; write "
            "hf://ORG/NAME@BRANCH, @TAG or @COMMIT (or leave out @ for main)"
        )
    hf_patterns(fragment, text=text)  # validates
    return ArtifactRef(text=text, scheme="hf", bucket=repo, location=revision or "main")


def hf_patterns(fragment: str, *, text: str = "") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(include, exclude) glob patterns of an hf:// ref's ``#include=A&exclude=B`` part
    (values percent-decoded; each key may repeat)."""
    include: list[str] = []
    exclude: list[str] = []
    for item in filter(None, fragment.split("&")):
        key, eq, value = item.partition("=")
        if key not in _HF_KEYS or not eq or not value:
            raise ConfigError(
                f"artifact ref {text!r}: {item!r} is not a file filter; write "
                "#include=GLOB&exclude=GLOB (e.g. #include=*.safetensors&include=*.json)"
            )
        (include if key == "include" else exclude).append(_unquote(value))
    return tuple(include), tuple(exclude)
