"""``hf://ORG/NAME[@REVISION]``: a model on the Hugging Face Hub (or a mirror, ``HF_ENDPOINT``).

Resolution asks the Hub once what commit the revision (branch, tag or sha; default
``main``) points at now, and lists that commit's files (the paginated recursive tree,
``hf_api``). The commit sha is the revision (``hf:<sha>``, plus a digest of the
``#include=...&exclude=...`` filters when there are any); the branch or tag is only the
label the store records under ``refs/``. Every file is fetched by commit, through
``/{repo}/resolve/{sha}/{path}``, so a branch that moves mid-pull cannot mix commits.

- LFS files (weights) carry their sha256 in the tree, which the store's fill checks. The
  resolve URL answers 302 to the storage host; that URL is resolved once per file (and
  again when the storage host refuses it, e.g. an expired signature) and the fill's
  parallel ranged path reads it through ``HttpSource``: splice(2) straight into the
  partial file on ``http://``, aiohttp otherwise. The token is never sent there.
- Git files (json, tokenizer, README) carry only their git blob id. Each is fetched
  whole (they are small: the Hub puts anything over 10 MiB in LFS) and checked against
  sha1(``"blob <size>\\0"`` + bytes) before any byte reaches the store
  (``GitBlobMismatch``); a range of one is cut from the verified file.
- Fingerprints are content ids (``hf-lfs`` + sha256, ``hf-git`` + blob id), so a file
  unchanged between two commits is not fetched again: the store already holds its blob.

Include/exclude patterns are matched like ``huggingface-cli download`` (``fnmatchcase``
on the path; a pattern ending in ``/`` matches everything under it).
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
from collections.abc import AsyncGenerator, Callable, Mapping
from urllib.parse import quote, urljoin

import aiohttp

from preheat.artifacts.manifest import FileEntry, Manifest
from preheat.artifacts.refs import ArtifactRef, hf_patterns, redact_url
from preheat.errors import (
    ConfigError,
    FetchError,
    GitBlobMismatch,
    ObjectNotFound,
    OriginUnavailable,
    TruncatedBody,
)
from preheat.sources import _splice
from preheat.sources.base import Location, Resolution, Unsupported
from preheat.sources.hf_api import HubApi, HubFile, find_token, hub_endpoint, hub_error, same_origin
from preheat.sources.http import HttpSource

_REDIRECTS = 5


def selected(path: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    """Whether ``path`` passes the filters (huggingface_hub's ``filter_repo_objects``)."""

    def match(pats: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(path, p + "*" if p.endswith("/") else p) for p in pats)

    return (not include or match(include)) and not match(exclude)


class HfSource:
    def __init__(
        self, ref: ArtifactRef, *, endpoint_url: str | None = None, connections: int = 8
    ) -> None:
        self.ref = ref
        self.repo = ref.bucket
        self.rev = ref.location
        self.endpoint = hub_endpoint(endpoint_url)
        self.token = find_token()
        self._http = HttpSource(ref, connections=connections)
        self._session: aiohttp.ClientSession | None = None
        self._sha = ""
        self._files: dict[str, HubFile] = {}  # resolve URL -> file
        self._storage: dict[str, str] = {}  # resolve URL -> where its bytes are
        self._locks: dict[str, asyncio.Lock] = {}
        self._direct = True

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=60),
                auto_decompress=False,
            )
        return self._session

    def _api(self) -> HubApi:
        return HubApi(self._sess(), self.endpoint, self.token)

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _error(self, status: int, headers: Mapping[str, str], path: str) -> None:
        err = hub_error(
            status,
            headers,
            endpoint=self.endpoint,
            repo=self.repo,
            rev=self._sha or self.rev,
            token=self.token,
            path=path,
        )
        if err is not None:
            raise err

    # --- resolve ---------------------------------------------------------------------------

    async def resolve(self) -> Resolution:
        include, exclude = hf_patterns(self.ref.text.partition("#")[2], text=self.ref.text)
        api = self._api()
        sha = await api.commit(self.repo, self.rev)
        every = await api.files(self.repo, sha)
        files = [f for f in every if selected(f.path, include, exclude)]
        if not files:
            raise ConfigError(
                f"{self.ref.display}: the filters include={list(include)} "
                f"exclude={list(exclude)} match none of the {len(every)} files of "
                f"{self.repo}@{sha[:12]}; loosen them"
            )
        self._sha = sha
        entries, locations = [], {}
        for f in files:
            url = f"{self.endpoint}/{self.repo}/resolve/{sha}/{quote(f.path, safe='/')}"
            fp = f"hf-lfs\0{f.sha256}\0{f.size}" if f.sha256 else f"hf-git\0{f.oid}\0{f.size}"
            entries.append(FileEntry(f.path, f.size, f.sha256))
            locations[f.path] = Location(url=url, fingerprint=fp)
            self._files[url] = f
        revision = f"hf:{sha}"
        if include or exclude:
            filt = hashlib.sha256(repr((include, exclude)).encode()).hexdigest()[:12]
            revision += f"+{filt}"
        return Resolution(self.ref, revision, Manifest(tuple(entries)), locations, label=self.rev)

    # --- fetch -----------------------------------------------------------------------------

    def _file(self, location: Location) -> HubFile:
        f = self._files.get(location.url)
        if f is None:
            raise ObjectNotFound(f"{location.url} is not a file this source resolved")
        return f

    async def _where(self, location: Location, *, fresh: bool = False) -> str:
        """The URL an LFS file's bytes are read from: where its resolve URL redirects."""
        lock = self._locks.setdefault(location.url, asyncio.Lock())
        async with lock:
            if fresh:
                self._storage.pop(location.url, None)
            if location.url in self._storage:
                return self._storage[location.url]
            url = location.url
            f = self._file(location)
            for _ in range(_REDIRECTS):
                try:
                    async with self._sess().head(
                        url, headers=self._api().headers(url), allow_redirects=False
                    ) as resp:
                        self._error(resp.status, resp.headers, f.path)
                        target = resp.headers.get("Location")
                except aiohttp.ClientError as exc:
                    raise OriginUnavailable(f"{redact_url(url)}: {redact_url(str(exc))}") from None
                if resp.status not in (301, 302, 303, 307, 308) or not target:
                    break
                url = urljoin(url, target)
                if not same_origin(url, self.endpoint):
                    break  # the storage host: its own redirects are the fetch's business
            else:
                raise OriginUnavailable(f"{location.url}: more than {_REDIRECTS} redirects")
            self._storage[location.url] = url
            return url

    def _needs_token(self, url: str) -> bool:
        return self.token is not None and same_origin(url, self.endpoint)

    def can_direct(self, location: Location) -> bool:
        """splice(2) for LFS files on plain http:// (git files are verified in memory)."""
        f = self._files.get(location.url)
        return bool(_splice.AVAILABLE and self._direct and f is not None and f.sha256)

    async def fetch_to_fd(
        self,
        location: Location,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
    ) -> None:
        for fresh in (False, True):
            url = await self._where(location, fresh=fresh)
            if self._needs_token(url) or not self._http.can_direct(Location(url, "")):
                self._direct = False
                raise Unsupported(f"{redact_url(url)}: needs the full client")
            try:
                await self._http.fetch_to_fd(
                    Location(url, location.fingerprint), start, end, fd, on_bytes
                )
                return
            except ObjectNotFound:
                if fresh:
                    raise  # refused twice: not an expired signature

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        f = self._file(location)
        if f.sha256 is None:
            data = await self._git_file(location, f)
            yield data[start:end]
            return
        for fresh in (False, True):
            url = await self._where(location, fresh=fresh)
            stream = (
                self._get(url, start, end, f.path)
                if self._needs_token(url)
                else self._http.fetch(Location(url, location.fingerprint), start, end)
            )
            sent = False
            try:
                async for data in stream:
                    sent = True
                    yield data
                return
            except ObjectNotFound:
                if fresh or sent:
                    raise  # refused twice (or mid-body): not an expired signature
            finally:
                await stream.aclose()

    async def _git_file(self, location: Location, f: HubFile) -> bytes:
        """A git (non-LFS) file, whole, checked against its git blob id."""
        parts = [d async for d in self._get(location.url, 0, f.size, f.path)]
        data = b"".join(parts)
        if len(data) != f.size:
            raise TruncatedBody(f"{location.url}: {len(data)} bytes, the Hub lists {f.size}")
        actual = hashlib.sha1(b"blob %d\0" % f.size + data).hexdigest()
        if actual != f.oid:
            raise GitBlobMismatch(f.path, f.oid, actual)
        return data

    async def _get(self, url: str, start: int, end: int, path: str) -> AsyncGenerator[bytes, None]:
        """Bytes [start, end) of ``url``; redirects followed by hand so the token never
        leaves the endpoint's origin."""
        if start >= end:
            return
        pos = start
        try:
            for _ in range(_REDIRECTS):
                headers = {**self._api().headers(url), "Range": f"bytes={start}-{end - 1}"}
                async with self._sess().get(url, headers=headers, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                        url = urljoin(url, resp.headers["Location"])
                        continue
                    self._error(resp.status, resp.headers, path)
                    if resp.status == 200 and start:
                        await resp.content.readexactly(start)  # a server that ignores Range
                    while pos < end:
                        data = await resp.content.read(min(4 << 20, end - pos))
                        if not data:
                            break
                        pos += len(data)
                        yield data
                    if pos < end:
                        raise TruncatedBody(f"{redact_url(url)}: body ended at byte {pos} of {end}")
                    return
            raise OriginUnavailable(f"{redact_url(url)}: more than {_REDIRECTS} redirects")
        except FetchError:
            raise
        except (aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as exc:
            raise TruncatedBody(f"{redact_url(url)}: body ended at byte {pos}") from exc
        except aiohttp.ClientError as exc:
            raise OriginUnavailable(f"{redact_url(url)}: {redact_url(str(exc))}") from None
        except TimeoutError as exc:
            raise OriginUnavailable(f"{redact_url(url)}: read timed out at byte {pos}") from exc
