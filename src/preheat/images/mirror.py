"""A read-only, node-local registry mirror over the image cache (registry API v2).

``GET``/``HEAD`` of ``/v2/``, ``/v2/<name>/manifests/<tag|digest>`` and
``/v2/<name>/blobs/<digest>`` (with ``Range``) are answered from the images the store
holds: a manifest or blob is served when an image of repository ``<name>`` has it in
its view (an image pulled as ``registry:5000/team/app`` serves ``team/app``; containerd's
``?ns=<registry>`` query, else ``--upstream``'s host, narrows that to one registry); a
tag is served as it resolved at the last pull. Anything else falls through to the
upstream registry (the request is forwarded with its ``Accept``, ``Range`` and
``Authorization`` headers, the answer streamed back, a Bearer challenge included, so a
client authenticates with the upstream's token service as usual); without an upstream a
miss is a registry-style 404. Writes are 405: the mirror never changes the store.

Bind it to 127.0.0.1 (the default): the container runtime on the same node is the
client, and the cache has no per-repository access control of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from preheat.images.cache import ImageCache, ImageInfo
from preheat.images.manifest import blob_path
from preheat.images.mirror_tags import DEFAULT_TTL, TagRefresher

API = {"Docker-Distribution-API-Version": "registry/2.0"}
_FORWARD = ("Accept", "Range", "Authorization", "If-None-Match", "User-Agent")
_BACK = (
    "Content-Type",
    "Content-Length",
    "Content-Range",
    "Docker-Content-Digest",
    "WWW-Authenticate",
    "Location",
    "ETag",
    "Accept-Ranges",
)


@dataclass
class MirrorStats:
    hits: int = 0
    misses: int = 0
    upstream_errors: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


def _error(status: int, code: str, message: str) -> web.Response:
    body = json.dumps({"errors": [{"code": code, "message": message}]})
    return web.Response(status=status, text=body, content_type="application/json", headers=API)


class Mirror:
    def __init__(
        self, cache: ImageCache, upstream: str | None = None, *, tag_ttl: float = DEFAULT_TTL
    ) -> None:
        self.cache = cache
        self.upstream = upstream.rstrip("/") if upstream else None
        self.stats = MirrorStats()
        self.tags = (
            TagRefresher(self.upstream, cache.store.layout.refs, tag_ttl)
            if self.upstream and tag_ttl > 0
            else None
        )
        self._session: aiohttp.ClientSession | None = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=60),
                auto_decompress=False,
            )
        return self._session

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/v2/", self._root)
        app.router.add_route("*", "/v2/{name:.+}/manifests/{ref}", self._manifest)
        app.router.add_route("*", "/v2/{name:.+}/blobs/{digest}", self._blob)
        app.router.add_route("*", "/v2/{tail:.*}", self._other)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _images(self, request: web.Request, name: str) -> list[ImageInfo]:
        host = request.query.get("ns") or (urlsplit(self.upstream).netloc if self.upstream else "")
        out = []
        for img in self.cache.images():
            reg, _, repo = img.name.partition("/")
            if repo == name and (not host or reg == host):
                out.append(img)
        return out

    async def _root(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _error(405, "UNSUPPORTED", "this mirror is read-only")
        return web.json_response({}, headers=API)

    async def _other(self, request: web.Request) -> web.StreamResponse:
        return await self._miss(request, "other")

    async def _manifest(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _error(405, "UNSUPPORTED", "this mirror is read-only")
        name, ref = request.match_info["name"], request.match_info["ref"]
        images = self._images(request, name)
        if ref.startswith("sha256:"):
            want: str | None = ref
        elif self.tags is not None:
            held = [i for i in images if i.tag == ref]
            want = await self.tags.digest(self._sess(), name, ref, held, request.headers)
        else:
            want = next((i.top_digest for i in images if i.tag == ref), None)
        for img in images if want is not None else ():
            if want not in (img.digest, img.top_digest):
                continue
            path = img.view / blob_path(want)
            if not path.is_file():
                continue
            body = path.read_bytes()
            mt = json.loads(body).get("mediaType") or "application/vnd.oci.image.manifest.v1+json"
            self._hit("manifest")
            headers = {**API, "Docker-Content-Digest": want, "Content-Type": mt}
            if request.method == "HEAD":
                headers["Content-Length"] = str(len(body))
                return web.Response(status=200, headers=headers)
            return web.Response(status=200, body=body, headers=headers)
        return await self._miss(request, "manifest")

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _error(405, "UNSUPPORTED", "this mirror is read-only")
        name, digest = request.match_info["name"], request.match_info["digest"]
        if digest.startswith("sha256:") and len(digest) == 71:
            for img in self._images(request, name):
                path = img.view / blob_path(digest)
                if path.is_file():
                    self._hit("blob")
                    # FileResponse answers HEAD and Range (206, Content-Range) itself
                    return web.FileResponse(
                        path,
                        headers={
                            **API,
                            "Docker-Content-Digest": digest,
                            "Content-Type": "application/octet-stream",
                        },
                    )
        return await self._miss(request, "blob")

    def _hit(self, kind: str) -> None:
        self.stats.hits += 1
        self.stats.by_kind[f"hit_{kind}"] = self.stats.by_kind.get(f"hit_{kind}", 0) + 1

    async def _miss(self, request: web.Request, kind: str) -> web.StreamResponse:
        self.stats.misses += 1
        self.stats.by_kind[f"miss_{kind}"] = self.stats.by_kind.get(f"miss_{kind}", 0) + 1
        if self.upstream is None:
            return _error(
                404,
                "NAME_UNKNOWN"
                if kind == "other"
                else "MANIFEST_UNKNOWN"
                if kind == "manifest"
                else "BLOB_UNKNOWN",
                "not in this node's cache and no upstream is configured",
            )
        if request.method not in ("GET", "HEAD"):
            return _error(405, "UNSUPPORTED", "this mirror is read-only")
        url = f"{self.upstream}{request.path_qs}"
        headers = {k: request.headers[k] for k in _FORWARD if k in request.headers}
        try:
            async with self._sess().request(
                request.method, url, headers=headers, allow_redirects=True
            ) as up:
                out = web.StreamResponse(
                    status=up.status,
                    headers={k: up.headers[k] for k in _BACK if k in up.headers},
                )
                await out.prepare(request)
                if request.method == "GET":
                    async for chunk in up.content.iter_chunked(1 << 20):
                        await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.stats.upstream_errors += 1
            return _error(502, "UNAVAILABLE", f"upstream {self.upstream}: {type(exc).__name__}")


async def serve(
    cache: ImageCache,
    host: str,
    port: int,
    upstream: str | None,
    *,
    tag_ttl: float = DEFAULT_TTL,
) -> None:
    """Serve until cancelled."""
    import asyncio

    runner = web.AppRunner(Mirror(cache, upstream, tag_ttl=tag_ttl).app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


__all__ = ["Mirror", "MirrorStats", "serve"]
