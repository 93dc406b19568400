"""``oci://registry/repo:tag`` (or ``@sha256:...``): a CNCF ModelPack artifact as a source.

A ModelPack model is an OCI manifest with ``artifactType``
``application/vnd.cncf.model.manifest.v1+json`` (or a config of media type
``application/vnd.cncf.model.config.v1+json``) whose layers are the model's files:
``application/vnd.cncf.model.weight.v1.raw`` (and the other ``...model.<kind>.v1.raw``
kinds: ``weight.config``, ``doc``, ``code``, ``dataset``), each one file, its path in the
snapshot taken from the ``org.cncf.model.filepath`` annotation (checked: no ``..``, no
absolute path, no duplicates). Each file's sha256 is its layer digest, so the store
verifies every byte and a layer that did not change between two revisions is not
fetched again. The revision is the manifest's digest.

Not supported yet (named in the error): ``.tar``, ``.tar+gzip``, ``.tar+zstd`` layers (a
layer that unpacks into several files) and KServe modelcar images (files under
``/models`` of an ordinary image).

``RegistryBlobSource`` holds what every registry-backed source shares (the image cache's
``images.source`` too): small files served from memory, blobs by ranged GETs on the
fill's zero-copy splice path, or ``RegistryClient.blob`` when that path cannot serve
(TLS, redirects, a token to renew).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Mapping
from urllib.parse import urlsplit

from preheat.artifacts.manifest import FileEntry, Manifest, check_relpath
from preheat.artifacts.refs import ArtifactRef, redact_url
from preheat.errors import UnsafePath, UnsupportedMediaType
from preheat.images.auth import Credentials, load_credentials
from preheat.images.client import RegistryClient
from preheat.images.manifest import Descriptor, load, media_type_of, read_descriptor
from preheat.images.reference import ImageRef, parse_image_ref
from preheat.sources import _splice
from preheat.sources.base import Location, Resolution, Unsupported

MODEL_MANIFEST = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
FILEPATH = "org.cncf.model.filepath"
_KINDS = ("weight", "weight.config", "doc", "code", "dataset")
RAW_LAYERS = frozenset(f"application/vnd.cncf.model.{k}.v1.raw" for k in _KINDS)


def oci_ref(text: str) -> ArtifactRef:
    """``oci://registry/repo:tag`` as an ``ArtifactRef`` (the image reference is checked)."""
    parse_image_ref(text.removeprefix("oci://"))
    return ArtifactRef(text=text, scheme="oci", location=text.removeprefix("oci://"))


class RegistryBlobSource:
    """Blob fetching shared by registry-backed sources (see the module docstring)."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client
        self._memory: dict[str, bytes] = {}
        self._pools: dict[tuple[str, int], _splice.SplicePool] = {}
        self._splice_ok = True

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        await self.client.aclose()

    def can_direct(self, location: Location) -> bool:
        return (
            _splice.AVAILABLE
            and self._splice_ok
            and location.url not in self._memory
            and location.url.startswith("http://")
        )

    async def fetch_to_fd(
        self,
        location: Location,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
    ) -> None:
        parts = urlsplit(location.url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _splice.SplicePool(*key)
        shown = redact_url(location.url)
        try:
            await pool.get_range(
                parts.path,
                start,
                end,
                fd,
                on_bytes,
                shown,
                headers=await self.client.auth_headers(),
                check=functools.partial(_needs_client, shown),
            )
        except Unsupported:
            self._splice_ok = False  # redirects, a token to renew: the full client
            raise

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        data = self._memory.get(location.url)
        if data is not None:
            yield data[start:end]
            return
        async for chunk in self.client.blob(location.url, start, end):
            yield chunk


def _needs_client(shown: str, status: int, headers: Mapping[str, str]) -> None:
    if status in (301, 302, 303, 307, 308, 401):
        raise Unsupported(f"{shown}: HTTP {status} needs the full client")


class OciSource(RegistryBlobSource):
    """A ModelPack artifact at an OCI registry (credentials from docker ``config.json``)."""

    def __init__(
        self,
        ref: ArtifactRef,
        *,
        connections: int = 8,
        credentials: Credentials | None = None,
        retries: int = 5,
        backoff: float = 0.2,
    ) -> None:
        self.ref = ref
        self.image_ref: ImageRef = parse_image_ref(ref.location)
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

    async def resolve(self) -> Resolution:
        ref = self.image_ref
        got = await self.client.manifest(ref.reference)
        where = f"{ref.name}@{got.digest}"
        doc = load(got.body, where)
        mt = media_type_of(doc, got.media_type)
        config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
        config_mt = config.get("mediaType") if isinstance(config, dict) else None
        if doc.get("artifactType") != MODEL_MANIFEST and config_mt != MODEL_CONFIG:
            raise UnsupportedMediaType(
                f"{ref.text} is not a ModelPack model (media type {mt!r}, artifactType "
                f"{doc.get('artifactType')!r}, config {config_mt!r}; expected artifactType "
                f"{MODEL_MANIFEST!r}); for a container image use `preheat image pull`"
            )
        layers = doc.get("layers")
        if not isinstance(layers, list) or not layers:
            raise UnsupportedMediaType(f"{where}: a model needs at least one layer")
        files: dict[str, FileEntry] = {}
        locations: dict[str, Location] = {}
        for i, obj in enumerate(layers):
            d = _layer(obj, f"{where} layers[{i}]")
            path = _path(obj, f"{where} layers[{i}]")
            if path in files:
                raise UnsafePath(f"{where}: path {path!r} is named by two layers")
            files[path] = FileEntry(path, d.size, d.hex)
            locations[path] = Location(
                url=self.client.url("blobs", d.digest), fingerprint=f"sha256\0{d.hex}"
            )
        return Resolution(
            self.ref, got.digest, Manifest(tuple(files.values())), locations, label=ref.tag
        )


def _layer(obj: object, where: str) -> Descriptor:
    d = read_descriptor(obj, where)
    if d.media_type not in RAW_LAYERS:
        hint = (
            " (tar layers are not unpacked yet: push each file as a .raw layer)"
            if ".tar" in d.media_type
            else ""
        )
        raise UnsupportedMediaType(
            f"{where} has media type {d.media_type!r}{hint}; supported: "
            f"{', '.join(sorted(RAW_LAYERS))}"
        )
    return d


def _path(obj: dict[str, object], where: str) -> str:
    ann = obj.get("annotations")
    path = ann.get(FILEPATH) if isinstance(ann, dict) else None
    if not isinstance(path, str) or not path:
        raise UnsupportedMediaType(f"{where} has no {FILEPATH!r} annotation naming its file")
    try:
        check_relpath(path)
    except (UnsafePath, ValueError) as exc:
        raise UnsafePath(f"{where}: {FILEPATH} {path!r} escapes the snapshot ({exc})") from None
    return path
