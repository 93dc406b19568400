"""Manifests: the frozen file list of one revision, and its digest (pure: no I/O).

A manifest lists (relative path, size, sha256) per file. Its digest is the sha256 of the
sorted lines ``"<sha256> <size> <path>\\n"``; the source is left out, so the same files
reached through two origins give the same snapshot.

An entry's sha256 may be unknown when the origin publishes none (an S3 object without a
checksum, a plain file tree): the fill hashes those bytes while fetching and ``complete``
returns the manifest with every digest filled in.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from preheat.errors import ConfigError, UnsafePath

FORMAT = "preheat-manifest/v1"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative path inside a snapshot, else raise UnsafePath.

    Rejects absolute paths, ``..`` and ``.`` components, empty components, backslashes,
    NUL and control characters, so every path derived from a manifest stays in the root;
    and names a filesystem cannot hold (a component over 255 bytes, a path over 4095).
    """
    if not isinstance(path, str) or not path:
        raise UnsafePath(f"manifest path {path!r} is empty")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise UnsafePath(f"manifest path {path!r} is absolute; paths must be relative")
    if "\\" in path or any(ord(c) < 32 for c in path):
        raise UnsafePath(f"manifest path {path!r} contains a backslash or control character")
    if len(path.encode()) > 4095:
        raise UnsafePath(
            f"manifest path {path[:60]!r}... is {len(path.encode())} bytes; the limit is 4095"
        )
    parts = path.split("/")
    for part in parts:
        if len(part.encode()) > 255:
            raise UnsafePath(
                f"manifest path {path!r}: component {part[:40]!r}... is "
                f"{len(part.encode())} bytes; file names are limited to 255 bytes"
            )
        if part in ("", ".", ".."):
            raise UnsafePath(
                f"manifest path {path!r} has a {part or 'empty'!r} component; "
                "paths must stay inside the snapshot"
            )
    return path


def check_digest(value: str, *, what: str) -> str:
    v = value.lower().removeprefix("sha256:")
    if not _HEX64.match(v):
        raise ConfigError(f"{what}: {value!r} is not a sha256 digest (64 hex characters)")
    return v


@dataclass(frozen=True)
class FileEntry:
    """One file of a manifest. ``sha256`` is None until the bytes have been hashed."""

    path: str
    size: int
    sha256: str | None = None

    def __post_init__(self) -> None:
        check_relpath(self.path)
        if not isinstance(self.size, int) or self.size < 0:
            raise ConfigError(f"manifest entry {self.path!r}: size {self.size!r} is not >= 0")
        if self.sha256 is not None:
            object.__setattr__(
                self, "sha256", check_digest(self.sha256, what=f"manifest entry {self.path!r}")
            )


@dataclass(frozen=True)
class Manifest:
    """The files of one revision, sorted by path; paths are unique and none is a prefix dir of another."""

    files: tuple[FileEntry, ...]

    def __post_init__(self) -> None:
        files = tuple(sorted(self.files, key=lambda f: f.path))
        seen: set[str] = set()
        for f in files:
            if f.path in seen:
                raise ConfigError(f"manifest lists {f.path!r} twice")
            seen.add(f.path)
        for f in files:
            parts = f.path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in seen:
                    raise UnsafePath(
                        f"manifest path {f.path!r} needs {'/'.join(parts[:i])!r} as a "
                        "directory, but the manifest lists it as a file"
                    )
        object.__setattr__(self, "files", files)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def complete(self) -> bool:
        """True when every file's sha256 is known."""
        return all(f.sha256 is not None for f in self.files)

    @property
    def digest(self) -> str:
        """The manifest digest: identity of the snapshot. Needs every sha256."""
        if not self.complete:
            missing = [f.path for f in self.files if f.sha256 is None]
            raise ValueError(f"manifest digest needs every file's sha256; missing: {missing[:3]}")
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.sha256} {f.size} {f.path}\n".encode())
        return h.hexdigest()

    def with_digests(self, digests: Mapping[str, str]) -> Manifest:
        """A copy with the given path -> sha256 filled in."""
        return Manifest(
            tuple(
                replace(f, sha256=digests.get(f.path, f.sha256)) if f.sha256 is None else f
                for f in self.files
            )
        )

    def to_dict(self, *, revision: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT}
        if revision is not None:
            out["revision"] = revision
        out["files"] = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]
        return out

    def to_json(self, *, revision: str | None = None) -> str:
        return json.dumps(self.to_dict(revision=revision), indent=1, sort_keys=False)

    @classmethod
    def from_entries(cls, entries: Iterable[FileEntry]) -> Manifest:
        return cls(tuple(entries))

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "manifest") -> Manifest:
        """Parse a manifest document; every error names ``where`` and the bad field."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object with a 'files' list")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise ConfigError(f"{where}: format {fmt!r} is not {FORMAT!r}")
        files = data.get("files")
        if not isinstance(files, list):
            raise ConfigError(f"{where}: 'files' must be a list of {{path, size, sha256}}")
        entries = []
        for i, item in enumerate(files):
            if not isinstance(item, dict) or not {"path", "size"} <= set(item):
                raise ConfigError(f"{where}: files[{i}] needs 'path' and 'size' (and 'sha256')")
            if item.get("type", "file") != "file" or item.get("link") or item.get("symlink"):
                raise UnsafePath(
                    f"{where}: files[{i}] ({item.get('path')!r}) is a link; only regular files "
                    "are allowed"
                )
            size = item["size"]
            if isinstance(size, bool) or not isinstance(size, int):
                raise ConfigError(f"{where}: files[{i}] size {size!r} is not an integer")
            entries.append(FileEntry(str(item["path"]), size, item.get("sha256")))
        return cls(tuple(entries))

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "manifest") -> Manifest:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, where=where)


def revision_from_parts(kind: str, parts: Iterable[tuple[str, ...]]) -> str:
    """A revision id derived from origin metadata (S3 version ids/ETags, file mtimes).

    ``kind`` prefixes the id so the origin type is visible: ``s3-etag:1f3a...``.
    """
    h = hashlib.sha256()
    for p in sorted(parts):
        h.update(("\0".join(p) + "\n").encode())
    return f"{kind}:{h.hexdigest()[:40]}"


def revision_hex(revision: str) -> str:
    """Hex that stands for ``revision`` in Kubernetes names and labels: a ``sha256:``
    revision's own hex; any other revision (``hf:<commit>``, a filter suffix...) the
    sha256 of its text, so names built from it stay DNS-safe."""
    hexpart = revision.removeprefix("sha256:").lower()
    if hexpart and set(hexpart) <= set("0123456789abcdef"):
        return hexpart
    return hashlib.sha256(revision.encode()).hexdigest()
