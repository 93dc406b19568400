"""What preheat knows about a downloaded tar layer beyond its listing: how much unpacking
it stages (``unpacked_size``, for the space reservation), its sha256 read from disk
(``sha256_file``), and which revisions were built from it (``record_users`` /
``layer_users``: ``<store>/oci-layers/users-<hex>.json``, read when the layer's digest
is revoked, see docs/revocation.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import BinaryIO

from preheat.sources.oci_gzip import count

__all__ = ["layer_users", "record_users", "sha256_file", "unpacked_size", "write_json"]

_READ = 4 << 20


def unpacked_size(blob: Path, compression: str, size: int) -> int:
    """How many bytes unpacking the verified layer at ``blob`` stages, at most (the tar
    stream's length bounds its members): a plain tar's own size; gzip's last ISIZE
    trailer, or, when that is below what the compressed size implies (a layer of 4 GiB
    or more: ISIZE is the length mod 2**32; or several members, where it is the last
    one's), the length of every member counted (``oci_gzip.count``; a multi-member layer
    whose last trailer is big enough is counted while it unpacks, ``GzipMembers``); zstd's frame content
    sizes summed over every frame (``_zstd_declared``; the decoder refuses a frame that
    unpacks past its declared size), else, when a frame declares none, the decompressed
    length counted."""
    if compression == "gzip":
        with open(blob, "rb") as f:
            f.seek(max(0, size - 4))
            isize = int.from_bytes(f.read(4), "little")
            # gzip never grows data by more than ~0.03% plus its header: an ISIZE below
            # that bound is not the whole layer's length
            if isize + (size >> 9) + 1024 < size:
                return count(f.fileno(), size)
        return isize
    if compression == "zstd":
        import zstandard

        with open(blob, "rb") as f:
            declared = _zstd_declared(f, size)
            if declared is not None:
                return declared
            f.seek(0)
            total = 0
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
            with reader as r:
                while chunk := r.read(_READ):
                    total += len(chunk)
            return total
    return size


def _zstd_declared(f: BinaryIO, size: int) -> int | None:
    """The content sizes of every zstd frame in the ``size`` bytes of ``f`` summed,
    walking frame and block headers without decompressing (skippable frames unpack to
    nothing); None when a frame declares no size or the stream is not well formed (the
    caller counts instead, and unpacking reports the damage)."""
    import zstandard

    total, pos = 0, 0
    while pos < size:
        f.seek(pos)
        head = f.read(18)
        magic = int.from_bytes(head[:4], "little")
        if magic & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame: magic, size, payload
            pos += 8 + int.from_bytes(head[4:8], "little")
            continue
        try:
            declared = zstandard.get_frame_parameters(head).content_size
            pos += zstandard.frame_header_size(head)
        except zstandard.ZstdError:
            return None
        if declared == zstandard.CONTENTSIZE_UNKNOWN or declared < 0:
            return None
        total += declared
        while True:  # blocks: 3-byte header (last flag, type, size); RLE keeps 1 byte
            f.seek(pos)
            block = f.read(3)
            if len(block) < 3:
                return None
            word = int.from_bytes(block, "little")
            pos += 3 + (1 if (word >> 1) & 3 == 1 else word >> 3)
            if word & 1:
                break
        pos += 4 if head[4] & 0x04 else 0  # content checksum
    return total if pos == size else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def record_users(root: Path, revision: str, layers: list[str]) -> None:
    """Remember that snapshots of ``revision`` are built from the tar ``layers`` (hex
    digests): ``<store>/oci-layers/users-<hex>.json`` lists the revisions built from a
    layer, so revoking the layer digest removes them (``store.revoke``) although no blob
    of theirs is the layer itself."""
    for hexd in dict.fromkeys(layers):
        path = root / "oci-layers" / f"users-{hexd}.json"
        try:
            old = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            old = []
        users = sorted({*(str(x) for x in old if isinstance(old, list)), revision})
        if users != old:
            write_json(path, users)


def layer_users(root: Path, key: str) -> frozenset[str]:
    """The revisions ``record_users`` lists for the layer digest ``key`` in the store at
    ``root`` (none for a key that is not a digest or a layer never unpacked there)."""
    hexd = key.removeprefix("sha256:")
    try:
        raw = json.loads((root / "oci-layers" / f"users-{hexd}.json").read_text())
    except (FileNotFoundError, ValueError, OSError):
        return frozenset()
    return frozenset(str(r) for r in raw) if isinstance(raw, list) else frozenset()


def write_json(path: Path, doc: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    os.replace(tmp, path)
