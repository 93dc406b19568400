"""``oci://registry/repo:tag`` (or ``@sha256:...``): a model at an OCI registry as a source.

Two kinds of image are models:

- **CNCF ModelPack** (manifest ``artifactType`` ``application/vnd.cncf.model.manifest.v1+json``
  or config ``application/vnd.cncf.model.config.v1+json``). Layers of the kinds
  ``weight``, ``weight.config``, ``doc``, ``code``, ``dataset``:
  ``application/vnd.cncf.model.<kind>.v1.raw`` is one file, its path the
  ``org.cncf.model.filepath`` annotation (checked: no ``..``, no absolute path, no
  duplicates), its sha256 the layer digest; ``...v1.tar``, ``.tar+gzip``, ``.tar+zstd``
  unpack into files named by their tar members, as ``modctl extract`` does (the
  annotation, which modctl sets to the same relative path, is only checked to be safe).
  The spec's older names (``application/vnd.cnai.model.*``, ``org.cnai.model.filepath``)
  are read as the same types (``oci_modelpack``).
- **KServe modelcars**: any other image (an index picks the node's platform) whose
  files live under ``/models``; its layers are applied in order with the OCI whiteout
  rules and what ends under ``/models`` is the snapshot. An image with nothing there is
  ``NoModelFiles``.

Tar layers are fetched whole, checked against their digest, then unpacked safely
(``oci_layers``: no escapes, no symlinks, no devices, no duplicates) into a staging
directory the fill copies from (``oci_stage``). A layer's listing is kept by digest, so a
layer that did not change between two revisions is not fetched again. The revision is
the (platform) manifest's digest.

``RegistryBlobSource`` (``oci_blobs``, re-exported here) holds what every
registry-backed source shares.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path
from typing import Any

from preheat.artifacts.manifest import FileEntry, Manifest
from preheat.artifacts.refs import ArtifactRef, redact_url
from preheat.errors import NoModelFiles, Revoked, TruncatedBody, UnsafePath, UnsupportedMediaType
from preheat.images.auth import Credentials, load_credentials
from preheat.images.client import RegistryClient
from preheat.images.manifest import (
    INDEXES,
    MANIFESTS,
    Descriptor,
    choose_platform,
    load,
    media_type_of,
    parse_manifest,
)
from preheat.images.reference import ImageRef, Platform, node_platform, parse_image_ref
from preheat.sources.base import Location, Resolution, Unsupported
from preheat.sources.oci_blobs import RegistryBlobSource
from preheat.sources.oci_layer_meta import record_users
from preheat.sources.oci_layers import (
    IMAGE_TAR_LAYERS,
    MODEL_TAR_LAYERS,
    MODELCAR_ROOT,
    Member,
    Mode,
    apply_layers,
    merge_models,
)
from preheat.sources.oci_modelpack import (
    MODEL_MANIFEST,
    check_filepath,
    filepath,
    is_model,
    model_layer,
)
from preheat.sources.oci_stage import LayerStager

_COPY = 8 << 20  # bytes per copy of a staged tar member into the fill


def oci_ref(text: str) -> ArtifactRef:
    """``oci://registry/repo:tag`` as an ``ArtifactRef`` (the image reference is checked)."""
    parse_image_ref(text.removeprefix("oci://"))
    return ArtifactRef(text=text, scheme="oci", location=text.removeprefix("oci://"))


class OciSource(RegistryBlobSource):
    """A ModelPack artifact or a KServe modelcar image at an OCI registry (credentials
    from docker ``config.json``, credential helpers included)."""

    def __init__(
        self,
        ref: ArtifactRef,
        *,
        connections: int = 8,
        credentials: Credentials | None = None,
        retries: int = 5,
        backoff: float = 0.2,
        platform: Platform | None = None,
    ) -> None:
        self.ref = ref
        self.image_ref: ImageRef = parse_image_ref(ref.location)
        self.platform = platform
        creds = credentials or load_credentials(self.image_ref.registry)
        super().__init__(
            RegistryClient(
                self.image_ref,
                credentials=creds,
                connections=connections,
                retries=retries,
                backoff=backoff,
            )
        )
        self.layers = LayerStager(self.client, self._layer_direct)
        # tar-member URL -> (layer, compression, mode, sha256 of the file)
        self._members: dict[str, tuple[Descriptor, str, Mode, str]] = {}
        self._revoked: dict[str, tuple[str, float]] = {}
        self._copy_ok = True  # False once copy_file_range is refused (staging elsewhere)
        self._layout: Any = None  # the store's Layout (bind_store)

    def bind_store(
        self, layout: Any, revoked: Mapping[str, tuple[str, float]], space: Any = None
    ) -> None:
        """Keep tar-layer listings and staging in the store (reserved in its ``space``),
        and refuse what its revocation list names (digest -> (reason, since)) before
        fetching any layer (the puller calls this; the store checks the extracted files
        itself)."""
        self.layers.bind_store(Path(layout.root), space)
        self._layout = layout
        self._revoked = dict(revoked)

    def _refuse(self, digests: list[str], store: Path | None) -> None:
        for k in digests:
            if k in self._revoked:
                reason, since = self._revoked[k]
                when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(since))
                raise Revoked(
                    f"{self.ref.display} is revoked: {k} is on this store's revocation list "
                    f"since {when} ({reason}); nothing was fetched. Pull another version, or "
                    f"allow it again with `preheat image unrevoke {k} --store {store}`"
                )

    async def aclose(self) -> None:
        await self.layers.aclose()
        await super().aclose()

    def can_direct(self, location: Location) -> bool:
        if location.url in self._members:
            return self._copy_ok and hasattr(os, "copy_file_range")
        return super().can_direct(location)

    async def _layer_direct(
        self, url: str, start: int, end: int, fd: int, on_bytes: Callable[[int, int], None]
    ) -> None:
        """A whole tar layer's download on the zero-copy path of raw layers."""
        location = Location(url=url, fingerprint="")
        if not super().can_direct(location):
            raise Unsupported(f"{redact_url(url)}: no zero-copy path")
        await super().fetch_to_fd(location, start, end, fd, on_bytes)

    async def _staged(self, url: str) -> tuple[Path, int]:
        layer, compression, mode, sha = self._members[url]
        await self.layers.stage(layer, compression, mode, f"{self.image_ref.name}@{layer.digest}")
        return self.layers.staged(sha)

    def linked_bytes(self, blobs: Mapping[str, int]) -> int:
        """Of the blobs a pull will fetch (sha256 -> size), the bytes already staged on the
        store's filesystem, which ``take_file`` links into the fill instead of writing
        (``LayerStager.on_disk``); the puller's disk check leaves them out."""
        return self.layers.on_disk(blobs)

    async def take_file(self, location: Location, dest: Path) -> bool:
        """Hard-link the staged tar member at ``location`` to ``dest`` (the fill's
        partial file) instead of copying it: True when linked; False for anything else (a
        plain tar's member inside its layer file, a registry blob, staging on another
        filesystem), which the fill then copies."""
        if location.url not in self._members:
            return False
        path, base = await self._staged(location.url)
        if base:  # a plain tar's member: its bytes are inside the layer file
            return False
        try:
            await asyncio.to_thread(os.link, path, dest)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                return False
            raise
        return True

    async def fetch_to_fd(
        self,
        location: Location,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
    ) -> None:
        """A tar member: copied from staging in the kernel (``copy_file_range``); raises
        ``Unsupported`` where staging is on another filesystem. Else the registry's."""
        if location.url not in self._members:
            await super().fetch_to_fd(location, start, end, fd, on_bytes)
            return
        path, base = await self._staged(location.url)
        src = await asyncio.to_thread(os.open, path, os.O_RDONLY)
        try:
            pos = start
            while pos < end:
                try:
                    n = await asyncio.to_thread(
                        os.copy_file_range, src, fd, min(_COPY, end - pos), base + pos, pos
                    )
                except OSError as exc:
                    if exc.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        self._copy_ok = False
                        raise Unsupported(f"copy_file_range from {path}: {exc.strerror}") from exc
                    raise
                if n == 0:
                    raise TruncatedBody(f"{path}: staged file ended at byte {pos}, expected {end}")
                on_bytes(pos, n)
                pos += n
        finally:
            os.close(src)

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        if location.url not in self._members:
            async for chunk in super().fetch(location, start, end):
                yield chunk
            return
        path, base = await self._staged(location.url)
        with open(path, "rb") as f:
            f.seek(base + start)
            pos = start
            while pos < end:
                data = await asyncio.to_thread(f.read, min(end - pos, _COPY))
                if not data:
                    raise TruncatedBody(f"{path}: staged file ended at byte {pos}, expected {end}")
                pos += len(data)
                yield data

    async def resolve(self) -> Resolution:
        ref = self.image_ref
        got = await self.client.manifest(ref.reference)
        doc = load(got.body, f"{ref.name}@{got.digest}")
        mt = media_type_of(doc, got.media_type)
        self._refuse([got.digest], self.layers.root)
        if mt in INDEXES:  # a multi-platform modelcar: the node's platform
            plat = self.platform or _node_platform()
            desc = choose_platform(doc, plat, ref.text)
            got = await self.client.manifest(desc.digest)
            doc = load(got.body, f"{ref.name}@{got.digest}")
            mt = media_type_of(doc, got.media_type)
        raw = doc.get("layers")
        digests = (
            [str(x.get("digest")) for x in raw if isinstance(x, dict)]
            if isinstance(raw, list)
            else []
        )
        self._refuse([got.digest, *digests], self.layers.root)
        config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
        config_mt = config.get("mediaType") if isinstance(config, dict) else None
        if is_model(doc.get("artifactType"), config_mt):
            files = await self._modelpack(doc, f"{ref.name}@{got.digest}")
        else:
            files = await self._modelcar(doc, mt, got.digest, config_mt)
        entries = tuple(FileEntry(p, size, sha) for p, (size, sha, _) in sorted(files.items()))
        locations = {p: loc for p, (_, _, loc) in files.items()}
        await self._hand_off(files)
        if self.layers.root is not None and digests:  # every layer, whatever it added
            hexes = [d.removeprefix("sha256:") for d in digests]
            await asyncio.to_thread(record_users, self.layers.root, got.digest, hexes)
        return Resolution(self.ref, got.digest, Manifest(entries), locations, label=ref.tag)

    async def _hand_off(self, files: dict[str, _File]) -> None:
        """The unpacked members the pull will fetch (their blobs are not in the store)
        are reserved by the pull's fill, which links them from staging: off the staging
        reservation (``LayerStager.hand_off``), so they are not counted twice."""
        if self._layout is None:
            return
        layout = self._layout

        def missing() -> dict[str, int]:
            out: dict[str, int] = {}
            for size, sha, loc in files.values():
                member = self._members.get(loc.url)
                if member is not None and member[1] and sha and not layout.blob(sha).exists():
                    out[sha] = size
            return out

        await self.layers.hand_off(await asyncio.to_thread(missing))

    def _member(self, layer: Descriptor, compression: str, mode: Mode, m: Member) -> Location:
        assert m.sha256 is not None
        url = f"{self.client.url('blobs', layer.digest)}#{m.sha256}"
        self._members[url] = (layer, compression, mode, m.sha256)
        return Location(url=url, fingerprint=f"sha256\0{m.sha256}")

    async def _modelpack(self, doc: dict[str, object], where: str) -> dict[str, _File]:
        layers = doc.get("layers")
        if not isinstance(layers, list) or not layers:
            raise UnsupportedMediaType(f"{where}: a model needs at least one layer")
        files: dict[str, _File] = {}
        taken: dict[str, str] = {}
        wanted: list[tuple[Descriptor, str, Mode, str]] = []
        for i, obj in enumerate(layers):
            at = f"{where} layers[{i}]"
            d = model_layer(obj, at)
            if d.media_type in MODEL_TAR_LAYERS:
                check_filepath(obj, at)  # informational for a tar layer, but it must be safe
                wanted.append((d, MODEL_TAR_LAYERS[d.media_type], "model", at))
                continue
            path = filepath(obj, at)
            if path in taken:
                raise UnsafePath(f"{where}: path {path!r} is named by two layers")
            taken[path] = at
            url = self.client.url("blobs", d.digest)
            files[path] = (d.size, d.hex, Location(url=url, fingerprint=f"sha256\0{d.hex}"))
        got = await self.layers.diffs(wanted)  # every raw layer checked before any download
        tars = [(at, diff, d) for (d, _, _, at), diff in zip(wanted, got, strict=True)]
        merged = merge_models([(at, diff) for at, diff, _ in tars], taken)
        by_where = {at: d for at, _, d in tars}
        for path, m in merged.items():
            d = by_where[taken[path]]
            comp = MODEL_TAR_LAYERS[d.media_type]
            files[path] = (m.size, m.sha256, self._member(d, comp, "model", m))
        return files

    async def _modelcar(
        self, doc: dict[str, object], mt: str, digest: str, config_mt: object
    ) -> dict[str, _File]:
        ref = self.image_ref
        where = f"{ref.name}@{digest}"
        if mt not in MANIFESTS:
            raise UnsupportedMediaType(
                f"{ref.text} is not a ModelPack model nor a container image (media type "
                f"{mt!r}, artifactType {doc.get('artifactType')!r}, config {config_mt!r})"
            )
        image = parse_manifest(doc, Descriptor(mt, digest, 0), where)
        wanted: list[tuple[Descriptor, str, Mode, str]] = [
            (d, IMAGE_TAR_LAYERS[d.media_type], "modelcar", f"{where} layers[{i}]")
            for i, d in enumerate(image.layers)
        ]
        got = await self.layers.diffs(wanted)
        diffs = [(at, diff, d) for (d, _, _, at), diff in zip(wanted, got, strict=True)]
        owner: dict[str, Descriptor] = {}
        for _at, diff, d in diffs:  # which layer's staging holds each file's bytes
            for m in diff.members:
                if m.kind == "file" and m.sha256 is not None:
                    owner[m.sha256] = d
        tree = apply_layers((at, diff) for at, diff, _ in diffs)
        if not tree:
            raise NoModelFiles(
                f"{ref.text} is a container image with no files under /{MODELCAR_ROOT} (a "
                f"KServe modelcar keeps the model there) and not a ModelPack model "
                f"(artifactType {MODEL_MANIFEST!r}); for a container image use "
                "`preheat image pull`"
            )
        out: dict[str, _File] = {}
        for path, m in tree.items():
            assert m.sha256 is not None
            d = owner[m.sha256]
            out[path] = (
                m.size,
                m.sha256,
                self._member(d, IMAGE_TAR_LAYERS[d.media_type], "modelcar", m),
            )
        return out


_File = tuple[int, str | None, Location]  # size, sha256, where its bytes are


async def manifest_layers(source: str, revision: str) -> tuple[str, ...]:
    """The layer digests of the ``oci://`` ``source``'s revision ``revision`` (its
    manifest digest), asked of the registry: one manifest, no layer moves. What a
    revoked layer is matched against where no store recorded the unpacking (the
    Kubernetes operator, the local fleet)."""
    return (await revision_layers(source, revision))[1]


async def revision_layers(source: str, reference: str | None = None) -> tuple[str, tuple[str, ...]]:
    """``(manifest digest, layer digests)`` of the ``oci://`` ``source`` at ``reference``
    (default: the source's own tag or digest): one manifest, no layer moves (an image
    index has no layers of its own: none)."""
    ref = parse_image_ref(source.removeprefix("oci://"))
    client = RegistryClient(ref, credentials=load_credentials(ref.registry), retries=2)
    try:
        got = await client.manifest(reference or ref.reference)
    finally:
        await client.aclose()
    raw = load(got.body, f"{ref.name}@{got.digest}").get("layers")
    layers = raw if isinstance(raw, list) else []
    digests = tuple(str(x["digest"]) for x in layers if isinstance(x, dict) and "digest" in x)
    return got.digest, digests


def _node_platform() -> Platform:
    import platform as _platform

    return node_platform(_platform.system(), _platform.machine())
