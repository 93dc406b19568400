"""``file:///dir``: a directory tree (or a single file) on this machine.

The revision is a digest over (relative path, inode, size, mtime_ns, ctime_ns) of every
file, so a file rewritten in place is a new revision even when its mtime was restored;
sha256 is computed while copying. Symbolic links anywhere in the tree are refused.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

from preheat.artifacts.manifest import FileEntry, Manifest, check_relpath, revision_from_parts
from preheat.artifacts.refs import ArtifactRef
from preheat.errors import ObjectNotFound, OriginUnavailable, TruncatedBody, UnsafePath
from preheat.sources.base import Location, Resolution

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
            locations[rel] = Location(url=str(root / rel), fingerprint=fp)
            parts.append((rel, *ident))
        return Resolution(
            ref=self.ref,
            revision=revision_from_parts("file", parts),
            manifest=Manifest(tuple(entries)),
            locations=locations,
        )

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        try:
            fd = await asyncio.to_thread(os.open, location.url, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{location.url} disappeared from the origin") from exc
        except OSError as exc:
            raise OriginUnavailable(f"cannot read {location.url}: {exc}") from exc
        try:
            pos = start
            while pos < end:
                data = await asyncio.to_thread(os.pread, fd, min(_READ, end - pos), pos)
                if not data:
                    raise TruncatedBody(
                        f"{location.url} ended at byte {pos}, expected {end} (changed at origin?)"
                    )
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
        pieces so progress is reported and a cancelled fill stops soon."""
        try:
            src = await asyncio.to_thread(os.open, location.url, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{location.url} disappeared from the origin") from exc
        except OSError as exc:
            raise OriginUnavailable(f"cannot read {location.url}: {exc}") from exc
        try:
            pos = start
            while pos < end:
                n = await asyncio.to_thread(
                    os.copy_file_range, src, fd, min(_READ, end - pos), pos, pos
                )
                if n == 0:
                    raise TruncatedBody(
                        f"{location.url} ended at byte {pos}, expected {end} (changed at origin?)"
                    )
                on_bytes(pos, n)
                pos += n
        finally:
            os.close(src)

    async def aclose(self) -> None:
        return None
