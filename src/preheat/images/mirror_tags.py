"""Tags of the node mirror, re-resolved against the upstream every ``ttl`` seconds.

A cached image answers for its tag as the tag resolved at its last pull. With an
upstream and ``ttl > 0``, a tag whose resolution is older than ``ttl`` is asked again
(``HEAD /v2/<name>/manifests/<tag>`` accepting every type the pull accepts, the
client's ``Authorization`` forwarded): the same digest renews it; a new digest makes the mirror serve the tag as a
miss (the manifest is fetched through from the upstream, and the client then asks for
the new blobs by digest) until an image with that digest is in the store. An upstream
that cannot answer (down, 401, 5xx) leaves the last resolution in place and is asked
again on the next request. Digest references never refresh: a digest cannot move.

Each refresh is recorded like a pull's ref: ``refs/<key>/mirror`` holds the last one and
``refs/<key>/history.jsonl`` gets a line with ``"by": "mirror"`` (``key`` as for
``docker://<upstream host>/<name>:<tag>``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from preheat.images.cache import ImageInfo
from preheat.images.manifest import ACCEPT
from preheat.images.reference import parse_image_ref
from preheat.images.source import artifact_ref

DEFAULT_TTL = 300.0


@dataclass(frozen=True)
class TagState:
    digest: str  # what the tag points at upstream (an index or a manifest)
    resolved: float  # wall-clock time of that resolution


class TagRefresher:
    """The tag table of one mirror (see the module docstring)."""

    def __init__(
        self,
        upstream: str,
        refs: Path,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.host = upstream.split("://", 1)[-1].split("/", 1)[0]
        self.refs = refs
        self.ttl = ttl
        self.clock = clock
        self._tags: dict[tuple[str, str], TagState] = {}
        self.refreshed = 0
        self.changed = 0
        self.errors = 0

    async def digest(
        self,
        session: aiohttp.ClientSession,
        name: str,
        tag: str,
        held: Sequence[ImageInfo],
        headers: Mapping[str, str],
    ) -> str | None:
        """The digest the mirror should serve ``name:tag`` as (None: not known here)."""
        key = (name, tag)
        state = self._tags.get(key)
        if state is None and held:
            last = max(held, key=lambda i: i.pulled)
            state = TagState(last.top_digest, last.pulled)
        if state is None:
            return None
        now = self.clock()
        if self.ttl <= 0 or now - state.resolved < self.ttl:
            return state.digest
        fresh = await self._head(session, name, tag, headers)
        if fresh is None:
            self.errors += 1
            return state.digest
        self.refreshed += 1
        if fresh != state.digest:
            self.changed += 1
        self._tags[key] = TagState(fresh, now)
        self._record(name, tag, fresh, now, changed=fresh != state.digest)
        return fresh

    async def _head(
        self, session: aiohttp.ClientSession, name: str, tag: str, headers: Mapping[str, str]
    ) -> str | None:
        # every type, as the pull resolved it: the client's own Accept could name a
        # different object (a platform manifest instead of the index) for the same tag
        sent = {"Accept": ACCEPT}
        if "Authorization" in headers:
            sent["Authorization"] = headers["Authorization"]
        try:
            async with session.head(
                f"{self.upstream}/v2/{name}/manifests/{tag}", headers=sent
            ) as resp:
                got = resp.headers.get("Docker-Content-Digest")
                return got if resp.status == 200 and got else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    def _record(self, name: str, tag: str, digest: str, now: float, *, changed: bool) -> None:
        ref = artifact_ref(parse_image_ref(f"{self.host}/{name}:{tag}"))
        d = self.refs / ref.key
        d.mkdir(parents=True, exist_ok=True)
        entry = {
            "ref": ref.display,
            "revision": digest,
            "label": tag,
            "resolved": now,
            "changed": changed,
            "by": "mirror",
        }
        line = json.dumps(entry)
        tmp = d / f".mirror.{os.getpid()}.{uuid.uuid4().hex[:6]}"
        tmp.write_text(line + "\n")
        os.replace(tmp, d / "mirror")
        with open(d / "history.jsonl", "a") as f:
            f.write(line + "\n")
