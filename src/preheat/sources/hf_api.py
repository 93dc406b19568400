"""The few Hugging Face Hub API calls ``hf://`` needs, and the Hub's conventions.

- Endpoint: ``--endpoint-url``, else ``$HF_ENDPOINT`` (a mirror or a private Hub), else
  ``https://huggingface.co``.
- Token: ``$HF_TOKEN`` (or the older ``$HUGGING_FACE_HUB_TOKEN``), else the file that
  ``hf auth login`` writes: ``$HF_TOKEN_PATH``, else ``$HF_HOME/token`` (``HF_HOME``
  defaults to ``$XDG_CACHE_HOME/huggingface``, i.e. ``~/.cache/huggingface``). It is sent
  only as ``Authorization: Bearer`` to the endpoint's own origin, never to the storage
  host a download is redirected to, and never appears in a message: ``Token`` prints as
  where it came from.
- ``commit(repo, rev)``: ``GET /api/models/{repo}/revision/{rev}`` -> the commit sha.
- ``files(repo, sha)``: ``GET /api/models/{repo}/tree/{sha}?recursive=true``, following
  the ``Link: <...>; rel="next"`` pages (only on the endpoint's origin).
- Errors from ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
  ``GatedRepo``) and ``X-Error-Message``, each saying what to do: ``hub_error``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from preheat.artifacts.refs import redact_url
from preheat.errors import (
    FetchError,
    HubAccessDenied,
    HubRepoNotFound,
    HubRevisionNotFound,
    ObjectNotFound,
    OriginUnavailable,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
_ATTEMPTS = 3


def hub_endpoint(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The Hub to talk to: ``explicit``, else ``$HF_ENDPOINT``, else huggingface.co."""
    env = os.environ if env is None else env
    return (explicit or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class Token:
    """A Hub token and where it was found; ``str``/``repr`` show only where."""

    value: str = field(repr=False)
    source: str

    def __str__(self) -> str:
        return self.source


def find_token(env: Mapping[str, str] | None = None) -> Token | None:
    """The token huggingface_hub would use, or None (see the module docstring)."""
    env = os.environ if env is None else env
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        value = env.get(name, "").strip()
        if value:
            return Token(value, f"${name}")
    home = env.get("HF_HOME") or str(
        Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    )
    path = Path(env.get("HF_TOKEN_PATH") or Path(home) / "token").expanduser()
    try:
        value = path.read_text().strip()
    except OSError:
        return None
    return Token(value, f"the token file {path}") if value else None


def same_origin(a: str, b: str) -> bool:
    x, y = urlsplit(a), urlsplit(b)
    return (x.scheme, x.hostname, x.port) == (y.scheme, y.hostname, y.port)


@dataclass(frozen=True)
class HubFile:
    """One file of a commit: ``oid`` is its git blob id, ``sha256`` set for LFS files."""

    path: str
    size: int
    oid: str
    sha256: str | None


def hub_error(
    status: int,
    headers: Mapping[str, str],
    *,
    endpoint: str,
    repo: str,
    rev: str,
    token: Token | None,
    path: str | None = None,
) -> FetchError | None:
    """The error for a Hub answer (None for a 2xx/3xx), from ``X-Error-Code``."""
    if status < 400:
        return None
    code = headers.get("X-Error-Code", "")
    said = redact_url(headers.get("X-Error-Message", ""))[:200]
    page = f"{endpoint}/{repo}"
    if status == 401 and said.startswith("Invalid credentials"):
        return HubAccessDenied(
            f"{endpoint} refused the token from {token} as invalid (401 {said}); create a "
            f"new one at {endpoint}/settings/tokens and set HF_TOKEN to it"
        )
    if code == "RepoNotFound":
        how = (
            "no token was sent: set HF_TOKEN (or run `hf auth login`) to a token that may read it"
            if token is None
            else f"the token from {token} may not read it: use a token of an account with access"
        )
        return HubRepoNotFound(
            f"{repo} was not found on {endpoint} ({status} RepoNotFound); check the name; "
            f"if it is private, {how}"
        )
    if code == "RevisionNotFound":
        return HubRevisionNotFound(
            f"{repo} has no revision {rev!r} on {endpoint} ({status} RevisionNotFound: "
            f"{said}); name a branch, tag or full commit sha: hf://{repo}@BRANCH"
        )
    if code == "GatedRepo":
        how = (
            f"no token was sent: accept its conditions at {page} and set HF_TOKEN to a "
            "token of that account"
            if token is None
            else f"the account of the token from {token} has not been granted access: "
            f"request it at {page}, or use a token of an account that has it"
        )
        return HubAccessDenied(f"{repo} is a gated model ({status} GatedRepo); {how}")
    where = f"{path!r} of {repo}@{rev}" if path else f"{repo}@{rev}"
    if code == "EntryNotFound" or status in (404, 410):
        return ObjectNotFound(f"{where} is not on {endpoint} ({status} {code or said})")
    if status in (401, 403):
        return HubAccessDenied(
            f"{endpoint} denied access to {where} ({status} {said}); check the token "
            f"({token or 'none sent'})"
        )
    return OriginUnavailable(f"{endpoint} answered HTTP {status} for {where} ({said})")


class HubApi:
    """The metadata calls, over the caller's aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, endpoint: str, token: Token | None):
        self.session = session
        self.endpoint = endpoint
        self.token = token

    def headers(self, url: str) -> dict[str, str]:
        """Request headers for ``url``: the token only for the endpoint's own origin."""
        out = {"User-Agent": "preheat", "Accept-Encoding": "identity"}
        if self.token is not None and same_origin(url, self.endpoint):
            out["Authorization"] = f"Bearer {self.token.value}"
        return out

    async def _get_json(self, url: str, repo: str, rev: str) -> tuple[Any, str | None]:
        """(JSON body, next page URL) of a GET, retrying 429/5xx and connection errors."""
        for attempt in range(_ATTEMPTS):
            try:
                async with self.session.get(url, headers=self.headers(url)) as resp:
                    err = hub_error(
                        resp.status,
                        resp.headers,
                        endpoint=self.endpoint,
                        repo=repo,
                        rev=rev,
                        token=self.token,
                    )
                    if err is None:
                        link = resp.links.get("next")
                        nxt = None if link is None else link.get("url")
                        return await resp.json(content_type=None), None if nxt is None else str(nxt)
                    if not isinstance(err, OriginUnavailable) or attempt == _ATTEMPTS - 1:
                        raise err
            except aiohttp.ClientError as exc:
                if attempt == _ATTEMPTS - 1:
                    raise OriginUnavailable(
                        f"cannot reach the Hub at {self.endpoint}: {redact_url(str(exc))}"
                    ) from None
            except TimeoutError:
                if attempt == _ATTEMPTS - 1:
                    raise OriginUnavailable(f"the Hub at {self.endpoint} timed out") from None
            await asyncio.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    async def commit(self, repo: str, rev: str) -> str:
        """The commit sha ``rev`` (branch, tag or sha) points at now."""
        url = f"{self.endpoint}/api/models/{repo}/revision/{quote(rev, safe='')}"
        info, _ = await self._get_json(url, repo, rev)
        sha = info.get("sha") if isinstance(info, dict) else None
        if not isinstance(sha, str) or len(sha) != 40:
            raise OriginUnavailable(
                f"{self.endpoint} answered no commit sha for {repo}@{rev}; is it a Hub?"
            )
        return sha

    async def files(self, repo: str, sha: str) -> list[HubFile]:
        """Every file of commit ``sha`` (all pages of the recursive tree)."""
        url: str | None = f"{self.endpoint}/api/models/{repo}/tree/{sha}?recursive=true"
        out: list[HubFile] = []
        pages = 0
        while url is not None:
            if not same_origin(url, self.endpoint):
                raise OriginUnavailable(
                    f"{self.endpoint} sent a next page on another host ({redact_url(url)}); "
                    "refusing to send the token there"
                )
            pages += 1
            if pages > 10_000:
                raise OriginUnavailable(f"{self.endpoint}: the tree of {repo} never ends")
            page, url = await self._get_json(url, repo, sha)
            for e in page if isinstance(page, list) else []:
                if not isinstance(e, dict) or e.get("type") != "file":
                    continue
                lfs = e.get("lfs") or None
                out.append(
                    HubFile(
                        path=str(e["path"]),
                        size=int(lfs["size"] if lfs else e["size"]),
                        oid=str(e["oid"]),
                        sha256=str(lfs["oid"]) if lfs else None,
                    )
                )
        return out
