"""Tar layers (ModelPack ``...v1.tar[+gzip|+zstd]``, image layers) read safely into files.

``scan_layer`` reads one verified layer blob (never a stream straight off the network:
the caller checks its digest first) and returns a ``LayerDiff``: each member under the
snapshot root, in tar order, with the bytes of every regular file written once to a
staging directory under their sha256. ``merge_models`` (ModelPack: every layer adds
files, no path twice) and ``apply_layers`` (a container image: later layers win, with
the OCI image-spec whiteouts) turn the diffs into the snapshot's files.

What is refused (``UnsafePath``, naming the layer and the member):

- a name that is absolute or has a ``..`` component (anywhere in the layer, even
  outside ``/models``: such a layer is malicious whatever it unpacks to);
- under the snapshot root: symbolic links (a snapshot is hard links to verified,
  content-addressed blobs; a symlink is not content, a replica would follow it out of
  the snapshot, and its target may change in a later layer: copy the target instead, as
  ``file://`` sources require), character/block devices, FIFOs and other special files;
- hard links whose target is not a regular file inside the snapshot (a hard link to one
  inside becomes a second path to the same blob: it is content, not a link on disk);
- a path twice in one layer (or, for ModelPack, in two layers), a path that is both a
  file and a directory, a root (``/models``) that is not a directory.

Modes: ``"model"`` (ModelPack: the root is the tar's root, whiteout names are ordinary
names) and ``"modelcar"`` (KServe: the root is ``models/`` of the image's filesystem,
everything outside it is skipped unread, ``.wh.<name>`` and ``.wh..wh..opq`` apply).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, cast

from preheat.artifacts.manifest import check_relpath
from preheat.errors import InsufficientSpace, UnsafePath, UnsupportedMediaType
from preheat.sources.oci_gzip import GzipMembers

#: ``grow(more)``: reserve ``more`` bytes of staging, or raise ``InsufficientSpace``.
Grow = Callable[[int], None]

Mode = Literal["model", "modelcar"]
MODELCAR_ROOT = "models"
_KINDS = ("weight", "weight.config", "doc", "code", "dataset")
#: ModelPack tar layer media type -> compression ("", "gzip", "zstd")
MODEL_TAR_LAYERS = {
    f"application/vnd.cncf.model.{k}.v1.tar{suffix}": comp
    for k in _KINDS
    for suffix, comp in (("", ""), ("+gzip", "gzip"), ("+zstd", "zstd"))
}
#: image layer media type -> compression
IMAGE_TAR_LAYERS = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
}
_WH = ".wh."
_OPAQUE = ".wh..wh..opq"
_COPY = 4 << 20


@dataclass(frozen=True)
class Member:
    """One entry under the snapshot root: a file (its bytes staged under ``sha256``), a
    directory, or a hard link to ``target`` (a root-relative path)."""

    path: str
    kind: Literal["file", "dir", "hardlink"]
    size: int = 0
    sha256: str | None = None
    target: str | None = None


@dataclass(frozen=True)
class LayerDiff:
    """What one layer does under the root: members in tar order, and (modelcar) the
    paths its whiteouts remove and the directories it makes opaque ("" is the root)."""

    members: tuple[Member, ...]
    whiteouts: tuple[str, ...] = ()
    opaque: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "members": [{k: v for k, v in vars(m).items() if v is not None} for m in self.members],
            "whiteouts": list(self.whiteouts),
            "opaque": list(self.opaque),
        }

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> LayerDiff:
        raw = doc.get("members")
        members = (
            tuple(Member(**m) for m in raw if isinstance(m, dict)) if isinstance(raw, list) else ()
        )
        wh, op = doc.get("whiteouts"), doc.get("opaque")
        return cls(
            members,
            tuple(str(x) for x in wh) if isinstance(wh, list) else (),
            tuple(str(x) for x in op) if isinstance(op, list) else (),
        )


def _open_tar(f: IO[bytes], compression: str, budget: int, grow: Grow) -> tarfile.TarFile:
    # tarfile's stream reads 10 KiB at a time by default: 4 MiB reads cost far less
    if compression == "zstd":
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        reader = dctx.stream_reader(f, read_size=_COPY, read_across_frames=True)
        return tarfile.open(fileobj=reader, mode="r|", bufsize=_COPY)
    if compression == "gzip":  # every member, not only the first as r|gz reads
        members = GzipMembers(f, os.fstat(f.fileno()).st_size, budget, grow)
        return tarfile.open(fileobj=cast("IO[bytes]", members), mode="r|", bufsize=_COPY)
    return tarfile.open(fileobj=f, mode="r:")  # a plain tar on disk: members read in place


def _stage(src: IO[bytes], size: int, staging: Path) -> str:
    """Copy one member's bytes into ``staging/<sha256>``; returns the sha256."""
    h = hashlib.sha256()
    tmp = staging / f".{uuid.uuid4().hex}"
    with open(tmp, "wb") as out:
        left = size
        while left:
            data = src.read(min(left, _COPY))
            if not data:
                raise UnsupportedMediaType(f"a member ended after {size - left} of {size} bytes")
            h.update(data)
            out.write(data)
            left -= len(data)
    digest = h.hexdigest()
    os.replace(tmp, staging / digest)
    return digest


def _hash_in_place(f: IO[bytes], offset: int, size: int) -> str:
    """The sha256 of ``size`` bytes at ``offset`` of the (plain tar) layer file."""
    h = hashlib.sha256()
    buf = bytearray(_COPY)
    view = memoryview(buf)
    fd, pos, end = f.fileno(), offset, offset + size
    while pos < end:
        n = os.preadv(fd, [view[: min(_COPY, end - pos)]], pos)
        if n == 0:
            raise UnsupportedMediaType(f"a member ended after {pos - offset} of {size} bytes")
        h.update(view[:n])
        pos += n
    return h.hexdigest()


def _relative(name: str, mode: Mode) -> str | None:
    """The root-relative path of a normalised member name ("" is the root itself), or
    None when the member lies outside the root (modelcar: outside ``models/``)."""
    if mode == "model":
        return name
    if name == MODELCAR_ROOT:
        return ""
    if name.startswith(MODELCAR_ROOT + "/"):
        return name[len(MODELCAR_ROOT) + 1 :]
    return None


def _normalise(raw: str, where: str) -> str:
    name = raw
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if raw.startswith("/"):
        raise UnsafePath(f"{where}: member {raw!r} has an absolute path; refused")
    if ".." in name.split("/"):
        raise UnsafePath(f"{where}: member {raw!r} escapes the snapshot ('..'); refused")
    return "" if name == "." else name


def scan_layer(
    blob: Path,
    media_type: str,
    compression: str,
    mode: Mode,
    staging: Path,
    where: str,
    in_place: dict[str, int] | None = None,
    budget: int = 1 << 62,
    grow: Grow = lambda _n: None,
) -> LayerDiff:
    """Read the layer at ``blob`` (already verified against its digest); see the module
    docstring for what it refuses. File bytes land in ``staging``; with ``in_place`` and
    an uncompressed layer they stay where they are in ``blob`` (the caller keeps it), and
    ``in_place`` gets sha256 -> offset of the bytes in ``blob``. A gzip layer unpacks at
    most ``budget`` bytes before ``grow(more)`` reserves more (``oci_gzip``)."""
    try:
        with open(blob, "rb") as f, _open_tar(f, compression, budget, grow) as tar:
            spot = in_place if compression == "" else None
            return _scan(tar, mode, staging, where, f if spot is not None else None, spot)
    except (UnsafePath, UnsupportedMediaType, InsufficientSpace):
        raise
    except _read_errors() as exc:
        raise UnsupportedMediaType(
            f"{where}: not a readable {media_type!r} layer ({type(exc).__name__}: {exc})"
        ) from None


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a truncated or corrupt tar, gzip or zstd stream raises."""
    import zlib

    import zstandard

    return (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, zstandard.ZstdError)


def _scan(
    tar: tarfile.TarFile,
    mode: Mode,
    staging: Path,
    where: str,
    layer: IO[bytes] | None = None,
    in_place: dict[str, int] | None = None,
) -> LayerDiff:
    members: list[Member] = []
    seen: set[str] = set()
    whiteouts: list[str] = []
    opaque: list[str] = []
    for info in tar:
        name = _normalise(info.name, where)
        what = f"{where}: member {info.name!r}"
        base = name.rsplit("/", 1)[-1]
        parent = name.rsplit("/", 1)[0] if "/" in name else ""
        if mode == "modelcar" and base.startswith(_WH):
            gone = parent if base == _OPAQUE else f"{parent}/{base[len(_WH) :]}".lstrip("/")
            # a whiteout of `models` or of a directory above it hides the whole root
            if gone == MODELCAR_ROOT or MODELCAR_ROOT.startswith(gone + "/") or gone == "":
                (opaque if base == _OPAQUE else whiteouts).append("")
            elif (rel := _relative(gone, mode)) is not None:
                (opaque if base == _OPAQUE else whiteouts).append(rel)
            continue
        rel = _relative(name, mode)
        if rel is None:
            continue  # outside /models: not read, not staged
        if rel == "":
            if not info.isdir():
                raise UnsafePath(f"{what}: the snapshot root is not a directory; refused")
            continue
        check_relpath(rel)
        if info.isdir():
            members.append(Member(rel, "dir"))
            continue
        if rel in seen:
            raise UnsafePath(f"{what}: the path {rel!r} appears twice in the layer; refused")
        seen.add(rel)
        if info.issym():
            raise UnsafePath(
                f"{what} is a symbolic link to {info.linkname!r}; links are refused in "
                "snapshots (they are not content and may point outside): copy the target"
            )
        if info.islnk():
            target = _relative(_normalise(info.linkname, where), mode)
            if not target:
                raise UnsafePath(
                    f"{what} is a hard link to {info.linkname!r}, outside the snapshot; refused"
                )
            members.append(Member(rel, "hardlink", target=check_relpath(target)))
            continue
        if not info.isreg():
            kind = "a device file" if info.ischr() or info.isblk() else "a FIFO or special file"
            raise UnsafePath(f"{what} is {kind}; refused")
        if layer is not None and in_place is not None and not info.issparse():
            sha = _hash_in_place(layer, info.offset_data, info.size)
            in_place.setdefault(sha, info.offset_data)
            members.append(Member(rel, "file", info.size, sha))
            continue
        src = tar.extractfile(info)
        assert src is not None  # a regular file always has a body
        members.append(Member(rel, "file", info.size, _stage(src, info.size, staging)))
    return LayerDiff(tuple(members), tuple(whiteouts), tuple(opaque))


def _drop(tree: dict[str, Member], path: str, *, keep_self: bool = False) -> None:
    """Remove ``path`` and everything under it ("" is the root)."""
    prefix = f"{path}/" if path else ""
    for p in [p for p in tree if p.startswith(prefix) or (p == path and not keep_self)]:
        del tree[p]


def _add(tree: dict[str, Member], m: Member, where: str) -> None:
    parts = m.path.split("/")
    for i in range(1, len(parts)):
        up = tree.get("/".join(parts[:i]))
        if up is not None and up.kind != "dir":
            raise UnsafePath(f"{where}: {m.path!r} is under {up.path!r}, which is a file")
    if m.kind == "dir":
        if (old := tree.get(m.path)) is not None and old.kind != "dir":
            del tree[m.path]
        tree.setdefault(m.path, m)
        return
    _drop(tree, m.path)
    if m.kind == "hardlink":
        t = tree.get(m.target or "")
        if t is None or t.kind != "file":
            raise UnsafePath(
                f"{where}: {m.path!r} is a hard link to {m.target!r}, which is not a regular "
                "file in the snapshot; refused"
            )
        m = Member(m.path, "file", t.size, t.sha256)
    tree[m.path] = m


def apply_layers(diffs: Iterable[tuple[str, LayerDiff]]) -> dict[str, Member]:
    """An image's layers (``(where, diff)`` bottom first) applied as the OCI image spec
    says: a layer's whiteouts and opaque markers hide what lower layers put there, then
    its members are added in order, a non-directory replacing whatever was at its path.
    Returns path -> file."""
    tree: dict[str, Member] = {}
    for where, diff in diffs:
        for w in diff.whiteouts:
            _drop(tree, w)
        for o in diff.opaque:
            _drop(tree, o, keep_self=True)
        for m in diff.members:
            _add(tree, m, where)
    return {p: m for p, m in tree.items() if m.kind == "file"}


def merge_models(
    diffs: Sequence[tuple[str, LayerDiff]], taken: dict[str, str]
) -> dict[str, Member]:
    """ModelPack tar layers: each one unpacked on its own (hard links within it), their
    files merged; a path already in ``taken`` (path -> the layer that has it, raw layers
    included) or in two layers is refused."""
    out: dict[str, Member] = {}
    for where, diff in diffs:
        for path, m in apply_layers([(where, diff)]).items():
            if path in taken:
                raise UnsafePath(f"{where}: path {path!r} is also in {taken[path]}; refused")
            taken[path] = where
            out[path] = m
    for path, where in taken.items():
        for up in _parents(path):
            if up in taken:
                raise UnsafePath(f"{where}: {path!r} is under {up!r}, a file of {taken[up]}")
    return out


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
