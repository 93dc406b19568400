"""The origin protocol: resolve a ref to a revision and manifest, then serve byte ranges.

A ``Source`` is an async adapter around one origin (a directory, an HTTP server, an S3
bucket). ``resolve()`` returns a ``Resolution``: the immutable revision the ref points at
now, the manifest, and per file a ``Location`` (where to fetch it, and a fingerprint of
the origin's metadata for the bytes). ``fetch(location, start, end)`` delivers bytes
``[start, end)`` as an async iterator of chunks, in order; it raises ``ObjectNotFound`` (do not
retry), ``OriginUnavailable`` or ``TruncatedBody`` (retry the rest of the range).

Every range is pinned to the validator ``resolve`` saw (``Location.etag``, ``modified``,
``version`` or ``stat``): a file that changed at the origin since then fails the range
with ``OriginChanged`` (not retried), so no blob ever mixes bytes of two versions.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Protocol

from preheat.artifacts.manifest import Manifest
from preheat.artifacts.refs import ArtifactRef, parse_ref
from preheat.errors import ConfigError, FetchError


class Unsupported(FetchError):
    """A source's zero-copy ``fetch_to_fd`` cannot serve this range (an origin answer that
    needs a full HTTP client, a copy across filesystems); the fill uses ``fetch`` instead."""


@dataclass(frozen=True)
class Location:
    """Where one file's bytes live at the origin.

    ``fingerprint`` names the bytes as the origin's metadata sees them (path+size+mtime,
    URL+ETag, bucket/key+version): when a file's sha256 is unknown, a fingerprint seen
    before maps to the digest hashed last time, so unchanged files are not fetched again.

    The validators pin every ranged read to the bytes ``resolve`` saw (None: not known):
    ``etag`` the entity tag as the origin sent it (HTTP ``If-Match``, S3 ``IfMatch``),
    ``modified`` the HTTP ``Last-Modified`` (used when there is no strong ETag),
    ``version`` an S3 version id, ``stat`` a local file's (st_ino, st_size, st_mtime_ns).
    """

    url: str
    fingerprint: str
    version: str | None = None
    etag: str | None = None
    modified: str | None = None
    stat: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Resolution:
    """What a ref names now.

    ``revision`` is derived from what proves identity (the manifest digest, S3 version
    ids, ETag + size + mtime, inode + size + mtime + ctime), never from a name the origin
    or the user chose; such a name (a manifest's ``"revision": "main"``) is kept as
    ``label``, for display only.
    """

    ref: ArtifactRef
    revision: str
    manifest: Manifest
    locations: Mapping[str, Location]
    label: str | None = None


def source_identity(ref: ArtifactRef, endpoint_url: str | None = None) -> str:
    """Which origin a resolution came from: the ref, plus the S3 endpoint it was read
    through. The store keys every resolution by (source identity, revision)."""
    if ref.scheme == "s3":
        return f"{ref.text} @ {endpoint_url or 'aws'}"
    if ref.scheme == "hf":
        from preheat.sources.hf_api import hub_endpoint

        return f"{ref.text} @ {hub_endpoint(endpoint_url)}"
    return ref.text


class Source(Protocol):
    ref: ArtifactRef

    async def resolve(self) -> Resolution: ...

    def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]: ...

    async def aclose(self) -> None: ...


def open_source(
    ref: str | ArtifactRef,
    *,
    endpoint_url: str | None = None,
    connections: int = 8,
) -> Source:
    """The adapter for a ref's scheme (imports boto3 only for s3://). ``endpoint_url`` is
    the S3 API endpoint for s3://, the Hub (instead of ``$HF_ENDPOINT``) for hf://."""
    r = parse_ref(ref) if isinstance(ref, str) else ref
    if endpoint_url is not None and r.scheme not in ("s3", "hf"):
        raise ConfigError(
            f"--endpoint-url {endpoint_url!r} only applies to s3:// and hf:// refs, not {r.text!r}"
        )
    if r.scheme == "hf":
        from preheat.sources.hf import HfSource

        return HfSource(r, endpoint_url=endpoint_url, connections=connections)
    if r.scheme == "oci":
        from preheat.sources.oci import OciSource

        return OciSource(r, connections=connections)
    if r.scheme == "file":
        from preheat.sources.file import FileSource

        return FileSource(r)
    if r.scheme in ("http", "https"):
        from preheat.sources.http import HttpSource

        return HttpSource(r, connections=connections)
    from preheat.sources.s3 import S3Source

    return S3Source(r, endpoint_url=endpoint_url, connections=connections)
