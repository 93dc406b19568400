"""Downloading one OCI layer blob whole into a file, checked against its digest.

``LayerFetcher.download`` is what ``oci_stage.LayerStager`` calls before it reads a byte
of a tar layer. A layer of 1 MiB or more goes through the zero-copy ``direct`` path
(``sources._splice``: up to 4 ranges at once, each resumed where it stopped, then hashed
from the page cache); a registry that answers something that path cannot take
(``Unsupported``: a redirect, an encoded body) switches this fetcher to streaming through
the registry client for good, hashing and writing 4 MiB at a time in a thread and
resuming after a dropped connection. Either way a digest that does not match raises
``ImageDigestMismatch`` and nothing is unpacked.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from preheat.errors import ImageDigestMismatch, OriginUnavailable, TruncatedBody
from preheat.images.client import RegistryClient
from preheat.images.manifest import Descriptor
from preheat.sources.base import Unsupported
from preheat.sources.oci_layer_meta import sha256_file

__all__ = ["Direct", "LayerFetcher", "first_failure"]

#: ``direct(url, start, end, fd, on_bytes)``: bytes [start, end) of ``url`` into ``fd``.
Direct = Callable[[str, int, int, int, Callable[[int, int], None]], Awaitable[None]]


class LayerFetcher:
    """Whole layers of one registry repository into files (see the module docstring)."""

    def __init__(self, client: RegistryClient, direct: Direct | None = None) -> None:
        self.client = client
        #: The zero-copy download (``None`` once this registry needed the full client).
        self._direct = direct

    async def download(self, d: Descriptor, dest: Path, where: str) -> None:
        """The whole layer into ``dest``, checked against its digest."""
        if self._direct is not None and d.size >= _SPLIT:
            try:
                await self._direct_ranges(d, dest)
            except Unsupported:
                self._direct = None  # this registry needs the full client
            else:
                digest = await asyncio.to_thread(sha256_file, dest)
                return self._check(d, digest, where)
        await self._stream(d, dest, where)

    async def _direct_ranges(self, d: Descriptor, dest: Path) -> None:
        """Spliced straight into the file in up to 4 ranges at once, each resumed where
        it stopped (``Unsupported``: the caller streams it instead)."""
        assert self._direct is not None
        url = self.client.url("blobs", d.digest)
        parts = max(1, min(4, d.size // _SPLIT))
        bounds = [d.size * i // parts for i in range(parts + 1)]
        fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, d.size)

            async def one(start: int, end: int) -> None:
                pos, attempt = start, 0
                assert self._direct is not None

                def landed(_offset: int, n: int) -> None:
                    nonlocal pos
                    pos += n

                while pos < end:
                    try:
                        await self._direct(url, pos, end, fd, landed)
                    except (OriginUnavailable, TruncatedBody):
                        attempt += 1
                        if attempt > self.client.retries:
                            raise
                        await asyncio.sleep(min(5.0, self.client.backoff * 2 ** (attempt - 1)))

            async with asyncio.TaskGroup() as tg:
                for a, b in itertools.pairwise(bounds):
                    tg.create_task(one(a, b))
        except BaseExceptionGroup as eg:
            raise first_failure(eg) from None
        finally:
            os.close(fd)

    def _check(self, d: Descriptor, digest: str, where: str) -> None:
        if digest != d.hex:
            raise ImageDigestMismatch(
                f"{where}: layer {d.digest} from the registry hashes to sha256:{digest}; "
                "refused before unpacking, nothing was published"
            )

    async def _stream(self, d: Descriptor, dest: Path, where: str) -> None:
        url = self.client.url("blobs", d.digest)
        h = hashlib.sha256()
        pos, attempt = 0, 0
        with open(dest, "wb") as f:
            while pos < d.size:
                buf: list[bytes] = []
                held = 0
                try:
                    async for chunk in self.client.blob(url, pos, d.size):
                        buf.append(chunk)
                        held += len(chunk)
                        if held >= _BATCH:  # write and hash in a thread, 4 MiB at a time
                            await asyncio.to_thread(_put, f, h, buf)
                            pos, held, buf = pos + held, 0, []
                    await asyncio.to_thread(_put, f, h, buf)
                    pos, held, buf = pos + held, 0, []
                except (OriginUnavailable, TruncatedBody):
                    await asyncio.to_thread(_put, f, h, buf)  # keep what arrived
                    pos += held
                    attempt += 1
                    if attempt > self.client.retries:
                        raise
                    await asyncio.sleep(min(5.0, self.client.backoff * 2 ** (attempt - 1)))
        self._check(d, h.hexdigest(), where)


_BATCH = 4 << 20
#: Layers from this size on are spliced, in ranges of at least this (smaller: streamed).
_SPLIT = 1 << 20


def first_failure(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first real failure in a task group's exceptions (not a cancellation)."""
    leaves: list[BaseException] = []
    todo: list[BaseException] = [eg]
    while todo:
        e = todo.pop(0)
        if isinstance(e, BaseExceptionGroup):
            todo[:0] = list(e.exceptions)
        else:
            leaves.append(e)
    real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
    return (real or leaves)[0]


def _put(f: Any, h: Any, chunks: list[bytes]) -> None:
    for c in chunks:  # no join: a 4 MiB copy saved per batch
        h.update(c)
    f.writelines(chunks)
