"""An OCI distribution (registry API v2) client on aiohttp: manifests, blobs, auth.

Why not a library: the Python OCI clients (oras-py, the opencontainers package) are
synchronous ``requests`` code that downloads a whole blob to a path; the node store's
fill wants byte ranges at offsets, a shared connection budget, a resume state and the
zero-copy splice path (``store.fill``). This module does only what the fill cannot:
the manifest requests, digest checks on manifests, and auth (``images.auth``);
``images.source`` hands the blobs to the fill.

Every request is retried on a 5xx, a reset or a timeout with exponential backoff
(``backoff * 2**n``, at most 5 s, ``retries`` times); 404s and auth failures are not.
A 401 runs the challenge once (``WWW-Authenticate``: Bearer token or Basic) and repeats
the request. Registry error bodies (``{"errors": [{"code": "MANIFEST_UNKNOWN"}]}``) become
messages that name the repository and tag.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from urllib.parse import urlencode

import aiohttp

from preheat.artifacts.refs import redact_url
from preheat.errors import (
    FetchError,
    ImageDigestMismatch,
    ImageNotFound,
    ObjectNotFound,
    OriginUnavailable,
    RangeNotSupported,
    RegistryAuthError,
    RegistryError,
    TruncatedBody,
)
from preheat.images.auth import Credentials, parse_challenge
from preheat.images.manifest import ACCEPT
from preheat.images.reference import ImageRef


@dataclass(frozen=True)
class Fetched:
    """A manifest as the registry sent it: bytes, media type, verified digest."""

    body: bytes
    media_type: str
    digest: str


def _codes(body: bytes) -> list[str]:
    import json

    try:
        doc = json.loads(body)
    except ValueError:
        return []
    errs = doc.get("errors") if isinstance(doc, dict) else None
    return [str(e.get("code")) for e in errs or [] if isinstance(e, dict)]


class RegistryClient:
    """Talks to the registry of one image reference (its repository's pull scope)."""

    def __init__(
        self,
        ref: ImageRef,
        *,
        credentials: Credentials | None = None,
        connections: int = 8,
        retries: int = 5,
        backoff: float = 0.2,
    ) -> None:
        self.ref = ref
        self.credentials = credentials
        self.retries = retries
        self.backoff = backoff
        self._connections = max(1, connections)
        self._session: aiohttp.ClientSession | None = None
        self._auth: str | None = None  # the Authorization header that worked last
        self._expires = float("inf")
        self._challenge_lock = asyncio.Lock()
        self.requests = 0  # HTTP requests sent (tests count them)

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections + 2),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=60),
                auto_decompress=False,
                read_bufsize=4 << 20,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, kind: str, reference: str) -> str:
        return f"{self.ref.base_url}/{self.ref.repository}/{kind}/{reference}"

    # --- auth -------------------------------------------------------------------------

    async def auth_headers(self) -> dict[str, str]:
        """The Authorization header to send now (a token about to expire is refreshed by
        the next 401)."""
        if self._auth is None or time.monotonic() > self._expires:
            return {}
        return {"Authorization": self._auth}

    async def _answer(self, header: str, used: str | None) -> None:
        """Run the challenge of a 401 (once per failed header: concurrent 401s share it)."""
        async with self._challenge_lock:
            if self._auth != used:
                return  # another request already answered it
            ch = parse_challenge(header)
            where = self.ref.registry
            if ch is None:
                raise RegistryAuthError(
                    f"registry {where} answered 401 without a Bearer or Basic challenge"
                )
            if ch.scheme == "basic":
                if self.credentials is None or used is not None:
                    raise RegistryAuthError(
                        f"registry {where} refused {'the' if used else 'no'} credentials "
                        f"(Basic); log in: add {where} to your docker config.json"
                    )
                self._auth = self.credentials.basic()
                return
            realm = ch.params.get("realm", "")
            if not realm.startswith(("http://", "https://")):
                raise RegistryAuthError(f"registry {where}: Bearer realm {realm!r} is not a URL")
            scope = ch.params.get("scope") or f"repository:{self.ref.repository}:pull"
            self._auth, self._expires = await self._token(realm, ch.params.get("service"), scope)

    async def _token(self, realm: str, service: str | None, scope: str) -> tuple[str, float]:
        query = {"scope": scope, **({"service": service} if service else {})}
        headers = {}
        creds = self.credentials
        method = "GET"
        data = None
        if creds is not None and creds.identity_token:
            method = "POST"
            data = {
                "grant_type": "refresh_token",
                "refresh_token": creds.identity_token,
                "client_id": "preheat",
                **query,
            }
        elif creds is not None:
            headers["Authorization"] = creds.basic()
        url = realm if data else f"{realm}?{urlencode(query)}"
        shown = redact_url(realm)
        try:
            self.requests += 1
            async with self._sess().request(method, url, headers=headers, data=data) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OriginUnavailable(f"token service {shown}: {type(exc).__name__}") from None
        if status in (401, 403):
            raise RegistryAuthError(
                f"token service {shown} refused the credentials for {scope} ({status}); "
                f"check the entry for {self.ref.registry} in your docker config.json"
            )
        if status != 200:
            raise OriginUnavailable(f"token service {shown} answered HTTP {status}")
        import json

        try:
            doc = json.loads(body)
            token = str(doc.get("token") or doc.get("access_token") or "")
        except (ValueError, AttributeError):
            token = ""
        if not token:
            raise RegistryAuthError(f"token service {shown} sent no token")
        # renew a little early; the spec's default lifetime is 60 s
        life = float(doc.get("expires_in") or 60)
        return f"Bearer {token}", time.monotonic() + max(1.0, life - 10)

    # --- requests ---------------------------------------------------------------------

    async def _request(
        self, method: str, url: str, headers: Mapping[str, str]
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One request with auth and retries; the whole body is read (manifests)."""
        shown = redact_url(url)
        attempt = 0
        challenged = 0
        while True:
            used = self._auth
            try:
                self.requests += 1
                async with self._sess().request(
                    method, url, headers={**headers, **(await self.auth_headers())}
                ) as resp:
                    body = await resp.read()
                    status, got = resp.status, resp.headers
                    if status == 401 and challenged < 2:
                        challenged += 1
                        await self._answer(got.get("WWW-Authenticate", ""), used)
                        continue
                    if status >= 500 or status == 429:
                        raise OriginUnavailable(f"{shown}: the registry answered HTTP {status}")
                    return status, got, body
            except FetchError as exc:
                if not isinstance(exc, OriginUnavailable):
                    raise
                err: Exception = exc
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                err = OriginUnavailable(f"{shown}: {type(exc).__name__}: {redact_url(str(exc))}")
            attempt += 1
            if attempt > self.retries:
                raise OriginUnavailable(f"{err} (gave up after {attempt} attempts)") from None
            await asyncio.sleep(min(5.0, self.backoff * 2 ** (attempt - 1)))

    async def ping(self) -> None:
        """``GET /v2/``: reachable, and auth learned up front."""
        status, _, _ = await self._request("GET", f"{self.ref.base_url}/", {})
        if status == 401:
            raise RegistryAuthError(f"registry {self.ref.registry} refused the credentials")

    async def _tags(self) -> list[str] | None:
        """The repository's tags ([] when the registry does not know the repository,
        None when it would not say): tells an unknown tag from an unknown repository."""
        url = f"{self.ref.base_url}/{self.ref.repository}/tags/list"
        try:
            status, _, body = await self._request("GET", url, {})
        except FetchError:
            return None
        if status == 404:
            return []
        if status != 200:
            return None
        import json

        try:
            tags = json.loads(body).get("tags") or []
        except (ValueError, AttributeError):
            return None
        return [str(t) for t in tags] or None

    async def manifest(self, reference: str) -> Fetched:
        """The manifest or index that ``reference`` (tag or digest) names, its bytes
        checked against the digest asked for, else the ``Docker-Content-Digest``."""
        url = self.url("manifests", reference)
        status, headers, body = await self._request("GET", url, {"Accept": ACCEPT})
        what = (
            f"{self.ref.name}:{reference}"
            if ":" not in reference
            else f"{self.ref.name}@{reference}"
        )
        if status == 404:
            codes = _codes(body)
            tags = None if reference.startswith("sha256:") else await self._tags()
            if "NAME_UNKNOWN" in codes or tags == []:
                raise ImageNotFound(
                    f"repository {self.ref.repository!r} not found at registry "
                    f"{self.ref.registry} (NAME_UNKNOWN); check the image name"
                )
            kind = "digest" if reference.startswith("sha256:") else "tag"
            has = f"; it has {', '.join(tags[:10])}" if tags else ""
            raise ImageNotFound(
                f"{kind} {reference!r} not found in repository {self.ref.repository!r} at "
                f"{self.ref.registry} ({', '.join(codes) or 'HTTP 404'}){has}"
            )
        if status in (401, 403):
            raise RegistryAuthError(
                f"registry {self.ref.registry} denied {what} ({status}); check your docker "
                "config.json credentials"
            )
        if status != 200:
            raise RegistryError(f"registry {self.ref.registry}: {what} answered HTTP {status}")
        actual = "sha256:" + hashlib.sha256(body).hexdigest()
        expected = (
            reference if reference.startswith("sha256:") else headers.get("Docker-Content-Digest")
        )
        if expected and expected != actual:
            raise ImageDigestMismatch(
                f"manifest {what}: the registry's bytes hash to {actual}, not {expected}; "
                "refused, nothing was published"
            )
        return Fetched(body, headers.get("Content-Type", ""), actual)

    async def blob(self, url: str, start: int, end: int) -> AsyncGenerator[bytes, None]:
        """Bytes [start, end) of a blob (the fill's fallback path), in order."""
        shown = redact_url(url)
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        pos = start
        for _challenge in range(3):
            used = self._auth
            try:
                self.requests += 1
                async with self._sess().get(
                    url, headers={**headers, **(await self.auth_headers())}
                ) as resp:
                    if resp.status == 401:
                        await self._answer(resp.headers.get("WWW-Authenticate", ""), used)
                        continue
                    if resp.status == 404:
                        raise ObjectNotFound(f"{shown}: blob not found in the registry (404)")
                    if resp.status in (403,):
                        raise ObjectNotFound(f"{shown}: the registry denied the blob (403)")
                    if resp.status >= 500 or resp.status == 429:
                        raise OriginUnavailable(f"{shown}: the registry answered {resp.status}")
                    if resp.status == 200 and start != 0:
                        raise RangeNotSupported(f"{shown} ignored the Range header (200)")
                    if resp.status not in (200, 206):
                        raise OriginUnavailable(f"{shown}: unexpected HTTP {resp.status}")
                    while pos < end:
                        data = await resp.content.readany()
                        if not data:
                            break
                        data = data[: end - pos]
                        pos += len(data)
                        yield data
                    break
            except FetchError:
                raise
            except aiohttp.ClientPayloadError as exc:
                raise TruncatedBody(f"{shown}: body ended at byte {pos}") from exc
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise OriginUnavailable(f"{shown}: {type(exc).__name__}") from None
            except TimeoutError as exc:
                raise OriginUnavailable(f"{shown}: read timed out at byte {pos}") from exc
        if pos < end:
            raise TruncatedBody(f"{shown}: body ended at byte {pos}, expected {end}")
