"""An image as a store ``Source``: resolve to an OCI image-layout view, blobs by range.

``resolve()`` asks the registry once for the tag (or digest), picks the platform from an
image index, checks every media type, and returns a ``Resolution`` whose manifest is the
image's OCI layout::

    oci-layout                       {"imageLayoutVersion":"1.0.0"}
    index.json                       one entry: the platform's manifest
    blobs/sha256/<manifest>          the manifest bytes (verified against its digest)
    blobs/sha256/<config>            the config blob
    blobs/sha256/<layer>...          each layer blob

Every file carries its sha256 (the OCI digest), so the store's fill verifies each blob,
shares it with every other image and model that has the same bytes, and skips what the
store holds. The revision is the platform manifest's digest: the image's identity. The
three small files are served from memory; config and layers are ranged GETs on
``/v2/<name>/blobs/<digest>`` (``sources.oci.RegistryBlobSource``: the fill's zero-copy
splice path over plain HTTP, else ``RegistryClient.blob``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from preheat.artifacts.manifest import FileEntry, Manifest
from preheat.artifacts.refs import ArtifactRef
from preheat.images.client import RegistryClient
from preheat.images.manifest import (
    INDEXES,
    OCI_LAYOUT_FILE,
    Descriptor,
    ImageManifest,
    blob_path,
    choose_platform,
    layout_index,
    load,
    media_type_of,
    parse_manifest,
)
from preheat.images.reference import ImageRef, Platform
from preheat.sources.base import Location, Resolution
from preheat.sources.oci import RegistryBlobSource


@dataclass(frozen=True)
class Resolved:
    """What a tag or digest named at the registry, for the cache's records."""

    top_digest: str  # what the tag points at: an index or the manifest
    image: ImageManifest
    platform: Platform | None  # chosen from an index; None for a single-platform tag


def artifact_ref(ref: ImageRef) -> ArtifactRef:
    """The store-side name of an image: ``docker://registry/repo:tag`` (not ``oci://``,
    which names OCI *model* artifacts: the same digest makes a different snapshot)."""
    return ArtifactRef(text=f"docker://{ref.text}", scheme="docker", location=ref.text)


class ImageSource(RegistryBlobSource):
    """One image of a registry; blobs are fetched as ``RegistryBlobSource`` does."""

    def __init__(self, client: RegistryClient, ref: ImageRef, platform: Platform) -> None:
        super().__init__(client)
        self.image_ref = ref
        self.platform = platform
        self.ref = artifact_ref(ref)
        self.resolved: Resolved | None = None

    async def resolve(self) -> Resolution:
        ref = self.image_ref
        top = await self.client.manifest(ref.reference)
        doc = load(top.body, ref.text)
        mt = media_type_of(doc, top.media_type)
        chosen: Platform | None = None
        body = top.body
        if mt in INDEXES:
            desc = choose_platform(doc, self.platform, ref.text)
            got = await self.client.manifest(desc.digest)
            body = got.body
            doc = load(body, f"{ref.name}@{desc.digest}")
            desc = Descriptor(
                desc.media_type or media_type_of(doc, got.media_type), desc.digest, len(body)
            )
            chosen = self.platform
        else:
            desc = Descriptor(mt, top.digest, len(body))
        image = parse_manifest(doc, desc, f"{ref.name}@{desc.digest}")
        self.resolved = Resolved(top.digest, image, chosen)
        return self._resolution(image, body, chosen, top.body if chosen else None)

    def _resolution(
        self, image: ImageManifest, body: bytes, chosen: Platform | None, index_body: bytes | None
    ) -> Resolution:
        """The view's files; with ``index_body`` the image index the tag named is kept in
        ``blobs/`` too (not listed in ``index.json``), so the node mirror can serve the tag
        as the registry did."""
        index = layout_index(image, chosen)
        files: dict[str, FileEntry] = {}
        locations: dict[str, Location] = {}
        manifest_url = self.client.url("manifests", image.descriptor.digest)
        small = [
            ("oci-layout", OCI_LAYOUT_FILE, f"{manifest_url}#oci-layout"),
            ("index.json", index, f"{manifest_url}#index.json"),
            (blob_path(image.descriptor.digest), body, manifest_url),
        ]
        if index_body is not None and self.resolved is not None:
            top = self.resolved.top_digest
            small.append((blob_path(top), index_body, self.client.url("manifests", top)))
        for path, data, url in small:
            digest = hashlib.sha256(data).hexdigest()
            files[path] = FileEntry(path, len(data), digest)
            self._memory[url] = data
            locations[path] = Location(url=url, fingerprint=f"sha256\0{digest}")
        for d in (image.config, *image.layers):
            path = blob_path(d.digest)
            if path in files:
                continue  # a layer listed twice (or equal to the config) is one file
            files[path] = FileEntry(path, d.size, d.hex)
            locations[path] = Location(
                url=self.client.url("blobs", d.digest), fingerprint=f"sha256\0{d.hex}"
            )
        manifest = Manifest(tuple(files.values()))
        label = self.image_ref.tag or (chosen.text if chosen else None)
        return Resolution(self.ref, image.descriptor.digest, manifest, locations, label=label)
