"""``file:///dir``: a directory tree (or a single file) on this machine.

The revision is a digest over (relative path, inode, size, mtime_ns, ctime_ns) of every
file, so a file rewritten in place is a new revision even when its mtime was restored;
sha256 is computed while copying. Symbolic links anywhere in the tree are refused.

Every range opens its file with ``O_NOFOLLOW`` (a link swapped in is refused) and
compares the descriptor's (st_ino, st_size, st_mtime_ns) with what ``resolve`` saw, before
reading and again after: a file replaced (new inode) or rewritten in place (new mtime)
mid-fill is ``OriginChanged``, never a blob of mixed bytes. A link swapped into a parent
directory leads to another inode, so the same comparison refuses it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

from preheat.artifacts.manifest import FileEntry, Manifest, check_relpath, revision_from_parts
from preheat.artifacts.refs import ArtifactRef
from preheat.errors import (
    ObjectNotFound,
    OriginChanged,
    OriginUnavailable,
    TruncatedBody,
    UnsafePath,
)
from preheat.sources.base import Location, Resolution, Unsupported

_READ = 8 << 20


class FileSource:
    def __init__(self, ref: ArtifactRef) -> None:
        self.ref = ref

    async def resolve(self) -> Resolution:
        return await asyncio.to_thread(self._resolve)

    def _resolve(self) -> Resolution:
        root = Path(self.ref.location)
        try:
            st = root.lstat()
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{self.ref.text}: {root} does not exist") from exc
        except OSError as exc:
            raise OriginUnavailable(f"{self.ref.text}: cannot read {root}: {exc}") from exc
        files: list[tuple[str, os.stat_result]] = []
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePath(f"{self.ref.text}: {root} is a symbolic link; give the real path")
        if stat.S_ISREG(st.st_mode):
            files.append((root.name, st))
            root = root.parent
        else:
            for dirpath, dirnames, filenames in os.walk(root):
                for name in sorted(dirnames + filenames):
                    p = Path(dirpath) / name
                    s = p.lstat()
                    rel = p.relative_to(root).as_posix()
                    if stat.S_ISLNK(s.st_mode):
                        raise UnsafePath(
                            f"{self.ref.text}: {rel!r} is a symbolic link; links are refused "
                            "because they can point outside the model (copy the target instead)"
                        )
                    if stat.S_ISREG(s.st_mode):
                        files.append((check_relpath(rel), s))
                    elif not stat.S_ISDIR(s.st_mode):
                        raise UnsafePath(f"{self.ref.text}: {rel!r} is not a regular file")
        if not files:
            raise ObjectNotFound(f"{self.ref.text}: the directory {root} holds no files")
        entries, locations, parts = [], {}, []
        for rel, s in files:
            # ctime too: rewriting a file in place and restoring its mtime (cp -p, rsync -t,
            # utime) keeps inode, size and mtime, but the kernel moves ctime forward
            ident = (str(s.st_ino), str(s.st_size), str(s.st_mtime_ns), str(s.st_ctime_ns))
            fp = "\0".join(("file", str(root / rel), *ident))
            entries.append(FileEntry(rel, s.st_size, None))
            locations[rel] = Location(str(root / rel), fp, stat=_identity(s))
            parts.append((rel, *ident))
        return Resolution(
            ref=self.ref,
            revision=revision_from_parts("file", parts),
            manifest=Manifest(tuple(entries)),
            locations=locations,
        )

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        fd = await asyncio.to_thread(_open_pinned, location)
        try:
            pos = start
            while pos < end:
                data = await asyncio.to_thread(os.pread, fd, min(_READ, end - pos), pos)
                if not data:
                    raise TruncatedBody(
                        f"{location.url} ended at byte {pos}, expected {end} (changed at origin?)"
                    )
                _check_unchanged(location, os.fstat(fd))
                yield data
                pos += len(data)
        finally:
            os.close(fd)

    def can_direct(self, location: Location) -> bool:
        return hasattr(os, "copy_file_range")

    async def fetch_to_fd(
        self,
        location: Location,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
    ) -> None:
        """Copy bytes [start, end) into ``fd`` in the kernel (copy_file_range(2)), in
        pieces so progress is reported and a cancelled fill stops soon. Raises
        ``Unsupported`` where the kernel cannot copy between the two filesystems."""
        src = await asyncio.to_thread(_open_pinned, location)
        try:
            pos = start
            while pos < end:
                try:
                    n = await asyncio.to_thread(
                        os.copy_file_range, src, fd, min(_READ, end - pos), pos, pos
                    )
                except OSError as exc:
                    if exc.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise Unsupported(
                            f"copy_file_range from {location.url}: {exc.strerror}"
                        ) from exc
                    raise
                if n == 0:
                    raise TruncatedBody(
                        f"{location.url} ended at byte {pos}, expected {end} (changed at origin?)"
                    )
                # the piece is in ``fd`` already; a change during the copy is caught here,
                # before it counts, and the fill then publishes nothing of this file
                _check_unchanged(location, os.fstat(src))
                on_bytes(pos, n)
                pos += n
        finally:
            os.close(src)

    async def aclose(self) -> None:
        return None


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _open_pinned(location: Location) -> int:
    """Open a file of the tree for reading, refusing a link and a file that changed."""
    try:
        fd = os.open(location.url, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ObjectNotFound(f"{location.url} disappeared from the origin") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OriginChanged(
                f"{location.url} changed at the origin since it was resolved: it is now a "
                "symbolic link, and links are refused (they can point outside the model); "
                "nothing of it was published"
            ) from exc
        raise OriginUnavailable(f"cannot read {location.url}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OriginChanged(
                f"{location.url} changed at the origin since it was resolved: it is no "
                "longer a regular file; nothing of it was published"
            )
        _check_unchanged(location, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_unchanged(location: Location, st: os.stat_result) -> None:
    """Raise ``OriginChanged`` unless ``st`` is the file ``resolve`` saw."""
    if location.stat is None or _identity(st) == location.stat:
        return
    names = ("inode", "size", "mtime_ns")
    what = ", ".join(
        f"{n} {a} -> {b}"
        for n, a, b in zip(names, location.stat, _identity(st), strict=True)
        if a != b
    )
    raise OriginChanged(
        f"{location.url} changed at the origin since it was resolved ({what}); nothing of "
        "it was published; pull again to fetch the new revision"
    )
