"""OCI and Docker manifests, image indexes and the image-layout view (pure: no I/O).

Media types accepted (OCI image-spec v1.1, Docker image manifest v2 schema 2):

- index: ``application/vnd.oci.image.index.v1+json``,
  ``application/vnd.docker.distribution.manifest.list.v2+json``: choose one platform.
- manifest: ``application/vnd.oci.image.manifest.v1+json``,
  ``application/vnd.docker.distribution.manifest.v2+json``.
- config: ``application/vnd.oci.image.config.v1+json``,
  ``application/vnd.docker.container.image.v1+json``.
- layers: OCI ``...image.layer.v1.tar`` (+gzip, +zstd), Docker
  ``...image.rootfs.diff.tar.gzip``.

Anything else (schema 1 manifests, foreign / non-distributable layers whose bytes live
at other URLs, artifacts) is ``UnsupportedMediaType`` naming the type. Descriptor digests
must be ``sha256:<64 hex>`` (the store is sha256-addressed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from preheat.errors import UnsupportedMediaType
from preheat.images.reference import Platform

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEXES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFESTS = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
#: the Accept header of a manifest GET: every type this client can read
ACCEPT = ", ".join(sorted(INDEXES | MANIFESTS))
CONFIGS = frozenset(
    {"application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json"}
)
LAYERS = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
    }
)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str  # sha256:<hex>
    size: int

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")

    def to_json(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class ImageManifest:
    """One platform's manifest: its own descriptor, config and layers."""

    descriptor: Descriptor
    config: Descriptor
    layers: tuple[Descriptor, ...]

    @property
    def size(self) -> int:
        """Bytes of the image: manifest, config and every layer."""
        return self.descriptor.size + self.config.size + sum(x.size for x in self.layers)


def read_descriptor(obj: object, where: str) -> Descriptor:
    if not isinstance(obj, dict):
        raise UnsupportedMediaType(f"{where}: a descriptor must be an object, got {obj!r:.80}")
    mt, digest, size = obj.get("mediaType"), obj.get("digest"), obj.get("size")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise UnsupportedMediaType(
            f"{where}: digest {digest!r} is not sha256:<64 hex> (only sha256 is supported)"
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise UnsupportedMediaType(f"{where}: size {size!r} is not a byte count")
    return Descriptor(str(mt or ""), digest, size)


def load(body: bytes, where: str) -> dict[str, object]:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise UnsupportedMediaType(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UnsupportedMediaType(f"{where}: not a JSON object")
    return doc


def media_type_of(doc: dict[str, object], header: str | None) -> str:
    """A manifest's media type: its ``mediaType`` field, else the Content-Type."""
    mt = doc.get("mediaType") or (header or "").split(";")[0].strip()
    if not mt and doc.get("schemaVersion") == 2 and "manifests" in doc:
        mt = OCI_INDEX
    elif not mt and doc.get("schemaVersion") == 2 and "layers" in doc:
        mt = OCI_MANIFEST
    return str(mt)


def choose_platform(doc: dict[str, object], platform: Platform, where: str) -> Descriptor:
    """The manifest of ``platform`` in an image index; the error lists what the index has."""
    entries = doc.get("manifests")
    if not isinstance(entries, list):
        raise UnsupportedMediaType(f"{where}: an image index needs a 'manifests' list")
    seen = []
    for i, e in enumerate(entries):
        p = e.get("platform") if isinstance(e, dict) else None
        if not isinstance(p, dict):
            continue
        seen.append(
            "/".join(str(x) for x in (p.get("os"), p.get("architecture"), p.get("variant")) if x)
        )
        if platform.matches(p):
            d = read_descriptor(e, f"{where} manifests[{i}]")
            if d.media_type and d.media_type not in MANIFESTS:
                raise UnsupportedMediaType(
                    f"{where}: the {platform.text} entry has media type {d.media_type!r}; "
                    f"supported: {', '.join(sorted(MANIFESTS))}"
                )
            return d
    raise UnsupportedMediaType(
        f"{where} has no image for platform {platform.text} (it has: "
        f"{', '.join(seen) or 'none'}); pass --platform with one of those"
    )


def parse_manifest(doc: dict[str, object], descriptor: Descriptor, where: str) -> ImageManifest:
    """An image manifest's config and layers, every media type checked."""
    mt = descriptor.media_type
    if mt not in MANIFESTS:
        raise UnsupportedMediaType(
            f"{where} has media type {mt!r}; supported: {', '.join(sorted(INDEXES | MANIFESTS))}"
        )
    config = read_descriptor(doc.get("config"), f"{where} config")
    if config.media_type not in CONFIGS:
        raise UnsupportedMediaType(
            f"{where}: config media type {config.media_type!r} is not an image config "
            f"(supported: {', '.join(sorted(CONFIGS))})"
        )
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise UnsupportedMediaType(f"{where}: a manifest needs a 'layers' list")
    layers = []
    for i, obj in enumerate(raw_layers):
        layer = read_descriptor(obj, f"{where} layers[{i}]")
        if layer.media_type not in LAYERS:
            raise UnsupportedMediaType(
                f"{where}: layer {i} ({layer.digest[:19]}) has media type "
                f"{layer.media_type!r}; supported: {', '.join(sorted(LAYERS))}"
            )
        layers.append(layer)
    return ImageManifest(descriptor, config, tuple(layers))


# --- the image-layout view ---------------------------------------------------------------

OCI_LAYOUT_FILE = b'{"imageLayoutVersion":"1.0.0"}'


def layout_index(image: ImageManifest, platform: Platform | None) -> bytes:
    """``index.json`` of a one-image OCI layout (deterministic bytes: the same image
    always gives the same view, so its snapshot digest depends on the image alone)."""
    entry: dict[str, object] = image.descriptor.to_json()
    if platform is not None:
        p: dict[str, object] = {"architecture": platform.architecture, "os": platform.os}
        if platform.variant:
            p["variant"] = platform.variant
        entry["platform"] = p
    doc = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry]}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def blob_path(digest: str) -> str:
    """Where a blob lives inside an OCI layout."""
    return f"blobs/sha256/{digest.removeprefix('sha256:')}"
