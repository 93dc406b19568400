"""``http(s)://``: a ``preheat-manifest.json`` naming files relative to it, or one file.

With a manifest, the revision is the manifest's digest (so it changes exactly when some
file's bytes do); a ``revision`` field in the manifest is only a label. A single file URL
resolves through HEAD: the revision is derived from URL, ETag, Last-Modified and size, and
the sha256 is computed while fetching. Byte ranges use ``Range: bytes=a-b`` over a pooled
aiohttp session with ``connections`` keep-alive connections, or the zero-copy splice pool.

Conditional ranges: a file resolved through HEAD is pinned to the validator HEAD saw. Every
ranged GET sends ``If-Match: <strong ETag>`` (else ``If-Unmodified-Since: <Last-Modified>``);
a 412, or an answer whose ETag / Last-Modified differs from the pinned one (a server that
ignores the condition, or answers 200 with the whole new body as ``If-Range`` would), is
``OriginChanged``. Manifest files carry their sha256, which the fill checks instead.

Messages show URLs through ``redact_url``: userinfo and query strings (presigned
signatures) never reach an error, a log line or a label.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import re
from collections.abc import AsyncGenerator, Callable, Mapping
from urllib.parse import unquote, urlsplit

import aiohttp

from preheat.artifacts.manifest import FileEntry, Manifest, revision_from_parts
from preheat.artifacts.refs import ArtifactRef, redact_url
from preheat.errors import (
    ConfigError,
    FetchError,
    ObjectNotFound,
    OriginChanged,
    OriginUnavailable,
    RangeNotSupported,
    TruncatedBody,
)
from preheat.sources import _splice
from preheat.sources.base import Location, Resolution, Unsupported

_SAFE = re.compile(r"[^A-Za-z0-9._~/-]")


def _quote(path: str) -> str:
    return _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), path)


def conditions(location: Location) -> dict[str, str]:
    """Request headers that make a ranged GET fail with 412 once the file has changed.

    ``If-Match`` needs a strong ETag (a weak one never matches); without one, the
    Last-Modified date pins the file to the second."""
    if location.etag and not location.etag.startswith("W/"):
        return {"If-Match": location.etag}
    if location.modified:
        return {"If-Unmodified-Since": location.modified}
    return {}


def check_answer(location: Location, shown: str, status: int, headers: Mapping[str, str]) -> None:
    """Raise ``OriginChanged`` when an answer is not about the bytes ``resolve`` saw.

    ``headers`` maps lower-case names to values. Checked before the status is read as
    success, so a 200 with the whole new body is a change, not a missing Range support."""
    fix = "nothing of it was published; pull again to fetch the new revision"
    if status == 412:
        pinned = location.etag or location.modified
        raise OriginChanged(
            f"{shown} changed at the origin since it was resolved (412 Precondition "
            f"Failed for {pinned}); {fix}"
        )
    if status not in (200, 206):
        return
    etag = headers.get("etag")
    if location.etag and etag and etag.removeprefix("W/") != location.etag.removeprefix("W/"):
        raise OriginChanged(
            f"{shown} changed at the origin since it was resolved (ETag {location.etag} "
            f"is now {etag}); {fix}"
        )
    modified = headers.get("last-modified")
    if location.modified and modified and modified != location.modified:
        raise OriginChanged(
            f"{shown} changed at the origin since it was resolved (Last-Modified "
            f"{location.modified} is now {modified}); {fix}"
        )


def _basic_auth(url: str) -> dict[str, str]:
    """The ``Authorization`` header for a URL's userinfo (what aiohttp sends for it)."""
    parts = urlsplit(url)
    if parts.username is None:
        return {}
    raw = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
    return {"Authorization": "Basic " + base64.b64encode(raw).decode("ascii")}


class HttpSource:
    def __init__(self, ref: ArtifactRef, *, connections: int = 8) -> None:
        self.ref = ref
        self._connections = max(1, connections)
        self._session: aiohttp.ClientSession | None = None
        self._pools: dict[tuple[str, int], _splice.SplicePool] = {}
        self._splice_ok = True

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._connections + 2, limit_per_host=self._connections + 2
                ),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=60),
                auto_decompress=False,
                read_bufsize=4 << 20,
            )
        return self._session

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def can_direct(self, location: Location) -> bool:
        """Whether ``fetch_to_fd`` (zero-copy) may serve this location."""
        return _splice.AVAILABLE and self._splice_ok and location.url.startswith("http://")

    async def fetch_to_fd(
        self,
        location: Location,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
    ) -> None:
        """Write bytes [start, end) straight into ``fd`` with splice(2); raises
        ``Unsupported`` (and stops using the fast path) when the origin's answer
        needs a full HTTP client."""
        parts = urlsplit(location.url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _splice.SplicePool(*key)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        shown = redact_url(location.url)
        try:
            await pool.get_range(
                path,
                start,
                end,
                fd,
                on_bytes,
                shown,
                headers={**conditions(location), **_basic_auth(location.url)},
                check=functools.partial(check_answer, location, shown),
            )
        except Unsupported:
            self._splice_ok = False
            raise

    async def resolve(self) -> Resolution:
        if self.ref.is_manifest_url:
            return await self._resolve_manifest()
        return await self._resolve_file()

    async def _resolve_manifest(self) -> Resolution:
        url = self.ref.location
        shown = redact_url(url)
        try:
            async with self._sess().get(url) as resp:
                _check_status(resp.status, shown)
                body = await resp.read()
        except aiohttp.ClientError as exc:
            raise OriginUnavailable(f"cannot fetch manifest {shown}: {_exc(exc)}") from None
        except TimeoutError as exc:
            raise OriginUnavailable(f"timed out fetching manifest {shown}") from exc
        manifest = Manifest.from_json(body, where=shown)
        if not manifest.complete:
            missing = [f.path for f in manifest.files if f.sha256 is None][:3]
            raise ConfigError(
                f"{shown}: every file needs a sha256 (missing for {missing}); regenerate it "
                "with `preheat cache manifest DIR`"
            )
        import json

        declared = json.loads(body).get("revision")
        # the declared name is a label: two models may both say "main", and an origin may
        # change its files under an unchanged name; the digest of the listed bytes may not
        revision = f"sha256:{manifest.digest}"
        base = url.rsplit("/", 1)[0]
        locations = {
            f.path: Location(url=f"{base}/{_quote(f.path)}", fingerprint=f"sha256\0{f.sha256}")
            for f in manifest.files
        }
        label = str(declared) if declared else None
        return Resolution(self.ref, revision, manifest, locations, label=label)

    async def _resolve_file(self) -> Resolution:
        url = self.ref.location
        shown = redact_url(url)
        try:
            async with self._sess().head(url, allow_redirects=True) as resp:
                _check_status(resp.status, shown)
                size = resp.headers.get("Content-Length")
                etag = resp.headers.get("ETag", "")
                modified = resp.headers.get("Last-Modified", "")
        except aiohttp.ClientError as exc:
            raise OriginUnavailable(f"cannot reach {shown}: {_exc(exc)}") from None
        except TimeoutError as exc:
            raise OriginUnavailable(f"timed out reaching {shown}") from exc
        if size is None:
            raise OriginUnavailable(f"{shown} sent no Content-Length; cannot fetch it in ranges")
        name = url.rsplit("/", 1)[-1].split("?", 1)[0] or "file"
        fp = f"http\0{url}\0{etag}\0{modified}\0{size}"
        entry = FileEntry(name, int(size), None)
        return Resolution(
            self.ref,
            revision_from_parts("http", [(url, etag, modified, size)]),
            Manifest((entry,)),
            {name: Location(url=url, fingerprint=fp, etag=etag or None, modified=modified or None)},
        )

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        url = location.url
        shown = redact_url(url)
        pos = start
        headers = {
            "Range": f"bytes={start}-{end - 1}",
            "Accept-Encoding": "identity",
            **conditions(location),
        }
        try:
            async with self._sess().get(url, headers=headers) as resp:
                check_answer(
                    location,
                    shown,
                    resp.status,
                    {k.lower(): resp.headers.get(k, "") for k in ("ETag", "Last-Modified")},
                )
                _check_status(resp.status, shown)
                if resp.status == 200 and start != 0:
                    raise RangeNotSupported(f"{shown} ignored the Range header (status 200)")
                reader = resp.content
                while pos < end:
                    data = await reader.readany()
                    if not data:
                        break
                    if pos + len(data) > end:
                        data = data[: end - pos]
                    pos += len(data)
                    yield data
        except FetchError:
            raise
        except aiohttp.ClientPayloadError as exc:
            raise TruncatedBody(f"{shown}: body ended at byte {pos} of range end {end}") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise OriginUnavailable(f"{shown}: {_exc(exc)}") from None
        except TimeoutError as exc:
            raise OriginUnavailable(f"{shown}: read timed out at byte {pos}") from exc
        if pos < end:
            raise TruncatedBody(f"{shown}: body ended at byte {pos}, expected {end}")


def _exc(exc: BaseException) -> str:
    """An aiohttp error as text, URL credentials redacted (some embed the request URL;
    the caller raises ``from None`` so the unredacted original is not chained either)."""
    return redact_url(f"{exc.__class__.__name__}: {exc}")


def _check_status(status: int, url: str) -> None:
    """Classify a status; ``url`` is already redacted."""
    if status in (200, 206):
        return
    if status in (404, 410):
        raise ObjectNotFound(f"{url}: the origin answered {status} (not found); check the URL")
    if status in (401, 403):
        raise ObjectNotFound(f"{url}: the origin answered {status} (access denied)")
    if status == 416:
        raise TruncatedBody(f"{url}: range not satisfiable (416); the file is shorter than listed")
    raise OriginUnavailable(f"{url}: the origin answered HTTP {status}")


# Re-exported for the fill's retry policy.
RETRYABLE = (OriginUnavailable, TruncatedBody, asyncio.TimeoutError)
