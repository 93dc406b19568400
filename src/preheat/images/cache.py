"""The node image cache: images pulled by digest into the node store, shared, referenced.

An image is a store snapshot whose directory is an OCI image layout (``images.source``):
its layers are blobs under their own digests, stored once per node and shared with every
other image and model that has the same bytes; the manifest, config, ``index.json`` and
``oci-layout`` sit beside them. ``skopeo copy oci:<view> ...`` and ``ctr import`` read
the view as it is. The ``images`` table says which snapshot is which image (name, tag,
platform, what the tag pointed at); a tag is a pointer resolved once per pull and
recorded with the time under ``refs/`` like a model ref.

References: ``ref(image, endpoint)`` leases the image's snapshot for holder
``image-ref:<endpoint>``, so no eviction ever takes it (the store's policy decides
among the rest); ``unref`` drops it and, when it was the last holder, removes the image
(the blobs only it used go with it). ``rm`` refuses a referenced image (``ImageInUse``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import platform as _platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preheat.errors import ConfigError, ImageInUse, Revoked, SnapshotNotFound
from preheat.images.auth import Credentials, load_credentials
from preheat.images.client import RegistryClient
from preheat.images.reference import ImageRef, Platform, node_platform, parse_image_ref
from preheat.images.source import ImageSource
from preheat.store.fill import DEFAULT_CHUNK
from preheat.store.pull_options import Progress, PullOptions
from preheat.store.revoke import normalise
from preheat.store.store import NodeStore

REF_PREFIX = "image-ref:"


@dataclass(frozen=True)
class ImagePull:
    """One ``pull``: the image digest (platform manifest), bytes moved, where it is."""

    digest: str
    name: str
    tag: str | None
    top_digest: str
    platform: str
    layers: int
    size: int
    bytes_fetched: int
    bytes_reused: int
    seconds: float
    view: Path

    def to_json(self) -> dict[str, object]:
        return _json(self)


@dataclass(frozen=True)
class ImageInfo:
    """An image the cache holds (``ls``)."""

    digest: str
    name: str
    tag: str | None
    top_digest: str
    platform: str
    snapshot: str
    config: str
    layers: int
    size: int
    pulled: float
    references: tuple[str, ...]
    view: Path

    def to_json(self) -> dict[str, object]:
        return _json(self)


def _json(obj: ImagePull | ImageInfo) -> dict[str, object]:
    """The record as JSON: paths as text, ``top_digest`` as ``index_digest``."""
    out: dict[str, object] = dataclasses.asdict(obj)
    out["index_digest"] = out.pop("top_digest")
    out["view"] = str(obj.view)
    if "references" in out:
        out["references"] = list(obj.references)  # type: ignore[union-attr]
    if "seconds" in out:
        out["seconds"] = round(float(str(out["seconds"])), 3)
    return out


def default_platform() -> Platform:
    """The platform of this node (``linux/amd64`` on an x86-64 Linux host)."""
    return node_platform(_platform.system(), _platform.machine())


def image_source(
    image_ref: ImageRef,
    plat: Platform,
    *,
    credentials: Credentials | None = None,
    connections: int = 8,
    docker_config: Path | None = None,
    retries: int = 3,
    backoff: float = 0.5,
) -> ImageSource:
    """A source for ``image_ref`` on ``plat`` (credentials: default the docker config's)."""
    creds = credentials
    if creds is None:
        creds = load_credentials(image_ref.registry, docker_config)
    client = RegistryClient(
        image_ref, credentials=creds, connections=connections, retries=retries, backoff=backoff
    )
    return ImageSource(client, image_ref, plat)


async def resolve_digests(
    ref: str, *, platform: Platform | None = None, docker_config: Path | None = None
) -> tuple[str, ...]:
    """The digests ``ref`` names now, ``(image manifest, index)`` (one when it points at
    a manifest), asked of the registry (manifests only, no layer moves). A digest
    reference answers itself, with no registry."""
    image_ref = parse_image_ref(ref)
    if image_ref.digest is not None:
        return (image_ref.digest,)
    source = image_source(image_ref, platform or default_platform(), docker_config=docker_config)
    try:
        await source.resolve()
    finally:
        await source.aclose()
    assert source.resolved is not None
    top = source.resolved.top_digest
    return tuple(dict.fromkeys((source.resolved.image.descriptor.digest, top)))


class ImageCache:
    """Images in one node store. ``docker_config``: the ``config.json`` to read
    credentials from (default ``$DOCKER_CONFIG/config.json`` or ``~/.docker``)."""

    def __init__(self, store: NodeStore, *, docker_config: Path | None = None) -> None:
        self.store = store
        self.docker_config = docker_config
        # the store facade keeps these private; the image cache is part of the store's
        # family (same DB, same puller), see the report for a public accessor
        self._db = store._db
        self._puller = store._puller

    # --- pulling -----------------------------------------------------------------------

    def pull(self, ref: str, **options: Any) -> ImagePull:
        """Resolve ``ref`` once, fetch the layers the store lacks, publish the view
        (blocking; ``options`` as for ``apull``)."""
        return asyncio.run(self.apull(ref, **options))

    async def apull(
        self,
        ref: str,
        *,
        platform: Platform | None = None,
        progress: Progress | None = None,
        connections: int = 8,
        chunk: int = DEFAULT_CHUNK,
        credentials: Credentials | None = None,
        rate_limit: float | None = None,
    ) -> ImagePull:
        """Pull ``ref`` (``platform``: default the node's; ``rate_limit``: bytes/s over
        all ``connections``; ``chunk``: one ranged request, the unit a resume skips;
        ``credentials``: default from the docker ``config.json``)."""
        t0 = time.monotonic()
        image_ref = parse_image_ref(ref)
        plat = platform or default_platform()
        if image_ref.digest is not None:
            self._refuse(image_ref)
            held = await asyncio.to_thread(self._held, image_ref.digest, plat)
            if held is not None:  # an immutable ref the store holds: no registry at all
                if progress is not None:
                    progress(held.size, held.size)
                return ImagePull(
                    held.digest,
                    held.name,
                    image_ref.tag,
                    held.top_digest,
                    held.platform,
                    held.layers,
                    held.size,
                    0,
                    held.size,
                    time.monotonic() - t0,
                    held.view,
                )
        source = self._source(image_ref, plat, credentials, connections)
        opts = PullOptions(rate_limit, connections, progress, chunk)
        opts.check()
        try:
            res = await source.resolve()
            result = await self._puller._pull_resolved(source.ref, res, source, t0, opts, None)
        finally:
            await source.aclose()
        assert source.resolved is not None
        r = source.resolved
        image = r.image
        plat_text = r.platform.text if r.platform else ""
        row = (
            image.descriptor.digest,
            image_ref.name,
            image_ref.tag,
            r.top_digest,
            plat_text,
            result.manifest_digest,
            image.config.digest,
            len(image.layers),
            image.size,
            time.time(),
        )
        await asyncio.to_thread(self._record, row)
        return ImagePull(
            digest=image.descriptor.digest,
            name=image_ref.name,
            tag=image_ref.tag,
            top_digest=r.top_digest,
            platform=plat_text,
            layers=len(image.layers),
            size=image.size,
            bytes_fetched=result.bytes_fetched,
            bytes_reused=result.bytes_reused,
            seconds=time.monotonic() - t0,
            view=result.snapshot,
        )

    def _source(
        self,
        image_ref: ImageRef,
        plat: Platform,
        credentials: Credentials | None = None,
        connections: int = 8,
    ) -> ImageSource:
        return image_source(
            image_ref,
            plat,
            credentials=credentials,
            connections=connections,
            docker_config=self.docker_config,
            retries=self.store.retries,
            backoff=self.store.backoff,
        )

    async def adigests(self, ref: str, *, platform: Platform | None = None) -> tuple[str, ...]:
        """The digests ``ref`` names now: ``(image manifest, index)`` (one when the tag
        points at a manifest). The store's record when it holds the image by that name
        or digest, else asked of the registry (manifests only, no layer moves). Revoked
        digests are answered too: this is how a revocation finds who runs them."""
        image_ref = parse_image_ref(ref)
        plat = platform or default_platform()
        with contextlib.suppress(SnapshotNotFound):
            img = await asyncio.to_thread(self.find, image_ref.digest or ref)
            return tuple(dict.fromkeys((img.digest, img.top_digest)))
        return await resolve_digests(ref, platform=plat, docker_config=self.docker_config)

    def _record(self, row: tuple[object, ...]) -> None:
        with self._db.write() as tx:
            tx.record_image(row)

    def _refuse(self, ref: ImageRef) -> None:
        with self._db.read() as tx:
            listed = tx.revoked()
        key = normalise(ref.digest or "")
        if key in listed:
            raise Revoked(
                f"image {ref.text} is revoked ({listed[key][0]}); nothing was fetched. "
                f"Allow it again with `preheat image unrevoke {key} --store {self.store.root}`"
            )

    def _held(self, digest: str, plat: Platform) -> ImageInfo | None:
        for img in self.images():
            if img.digest == digest or (
                img.top_digest == digest and img.platform in ("", plat.text)
            ):
                return img if img.view.is_dir() else None
        return None

    # --- what the cache holds ---------------------------------------------------------

    def images(self) -> list[ImageInfo]:
        """Every image in the store, most recently pulled first."""
        with self._db.read() as tx:
            rows = tx.images()
            out = []
            for d, name, tag, top, plat, snap, config, layers, size, pulled in rows:
                refs = tuple(
                    h.removeprefix(REF_PREFIX)
                    for h in tx.holders(str(snap))
                    if h.startswith(REF_PREFIX)
                )
                out.append(
                    ImageInfo(
                        str(d),
                        str(name),
                        None if tag is None else str(tag),
                        str(top),
                        str(plat),
                        str(snap),
                        str(config),
                        int(str(layers)),
                        int(str(size)),
                        float(str(pulled)),
                        refs,
                        self.store.layout.snapshot(str(snap)),
                    )
                )
        return out

    def find(self, key: str) -> ImageInfo:
        """The image named by digest (image or index, a unique prefix of 12+ hex) or by
        ``name:tag`` as pulled."""
        key = key.strip()
        images = self.images()
        digest = normalise(key) if key.startswith("sha256:") or len(key) == 64 else None
        for img in images:
            if digest in (img.digest, img.top_digest):
                return img
        hits = [
            i
            for i in images
            if len(key) >= 12
            and i.digest.removeprefix("sha256:").startswith(key.removeprefix("sha256:"))
        ]
        if len(hits) == 1:
            return hits[0]
        try:
            ref = parse_image_ref(key)
        except ConfigError:
            ref = None
        if ref is not None:
            named = [i for i in images if i.name == ref.name and i.tag == ref.tag]
            if named:
                return named[0]
        raise SnapshotNotFound(
            f"no image {key!r} in {self.store.root}; list them with "
            f"`preheat image ls --store {self.store.root}`"
        )

    # --- references -------------------------------------------------------------------

    def ref(self, key: str, endpoint: str) -> ImageInfo:
        """``endpoint`` uses the image: it is never evicted or removed while referenced."""
        if not endpoint:
            raise ConfigError("endpoint name must be non-empty, e.g. 'chat'")
        img = self.find(key)
        self.store.lease(img.snapshot, REF_PREFIX + endpoint)
        return self.find(img.digest)

    def unref(self, key: str, endpoint: str, *, remove: bool = True) -> bool:
        """Drop ``endpoint``'s reference; when it was the last holder of the image, the
        image is removed (``remove=False``: kept, unreferenced, for the eviction policy to
        take when space is needed, e.g. when a fleet stops and will start again).
        Returns whether the image was removed."""
        img = self.find(key)
        self.store.release(img.snapshot, REF_PREFIX + endpoint)
        if not remove or self.store.leases(img.snapshot):
            return False
        self._remove(img)
        return True

    def rm(self, key: str) -> ImageInfo:
        """Remove an image nobody references (its unshared blobs go with it)."""
        img = self.find(key)
        holders = self.store.leases(img.snapshot)
        if holders:
            refs = [h.removeprefix(REF_PREFIX) for h in holders]
            raise ImageInUse(
                f"image {img.name}@{img.digest[:19]} is referenced by {', '.join(refs)}; "
                "remove those references (endpoints) first"
            )
        self._remove(img)
        return img

    def _remove(self, img: ImageInfo) -> None:
        with self._db.write() as tx:
            tx.drop_image(img.digest)
        others = [i for i in self.images() if i.snapshot == img.snapshot]
        if not others:
            self.store.delete(img.snapshot)
