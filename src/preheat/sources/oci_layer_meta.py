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

__all__ = ["layer_users", "record_users", "sha256_file", "unpacked_size", "write_json"]

_READ = 4 << 20


def unpacked_size(blob: Path, compression: str, size: int) -> int:
    """How many bytes unpacking the verified layer at ``blob`` stages, at most (the tar
    stream's length bounds its members): a plain tar's own size; gzip's ISIZE trailer
    (the length mod 2**32, lifted by 4 GiB steps when it is below what the compressed
    size implies); zstd's frame content
    size (of the first frame: a multi-frame stream may stage more), else the decompressed
    length counted (a stream written without one)."""
    if compression == "gzip":
        with open(blob, "rb") as f:
            f.seek(max(0, size - 4))
            isize = int.from_bytes(f.read(4), "little")
        # gzip never grows data by more than ~0.03% plus its header: an ISIZE below that
        # bound is the length mod 2**32 of a layer of 4 GiB or more
        while isize + (size >> 9) + 1024 < size:
            isize += 1 << 32
        return isize
    if compression == "zstd":
        import zstandard

        with open(blob, "rb") as f:
            try:
                n = zstandard.frame_content_size(f.read(18))
            except zstandard.ZstdError:
                n = -1
            if n >= 0:
                return max(int(n), 0)
            f.seek(0)
            total = 0
            with zstandard.ZstdDecompressor().stream_reader(f) as r:
                while chunk := r.read(_READ):
                    total += len(chunk)
            return total
    return size


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
