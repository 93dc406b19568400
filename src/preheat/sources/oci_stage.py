"""Tar layers fetched once, verified, unpacked into a staging directory; listings kept.

A snapshot file that lives inside a tar layer has no URL of its own: ``LayerStager``
downloads the whole layer (``oci_layer_fetch``, resuming after a dropped connection),
checks its sha256 against the layer digest *before* reading a byte of the tar, unpacks it with
``oci_layers.scan_layer`` into a staging directory, each file once under its sha256.
The fill then hard-links a file from there into the store (``OciSource.take_file``) and
verifies it again on its way. A plain ``.tar`` layer is not unpacked at all: its members
are hashed where they lie in the downloaded layer and copied from there
(``copy_file_range``, in the kernel).

The listing of a layer (its ``LayerDiff``: paths, sizes, sha256s, whiteouts) depends on
the layer's bytes alone, so it is kept under ``<store>/oci-layers/<mode>-<digest>.json``
once the source is bound to a store (``bind_store``, called by the puller). The next
revision that reuses the layer resolves without fetching it, and when the store holds
every blob of it, nothing of it moves at all. Unbound (``preheat cache resolve``), the
listing lives in memory and staging in the system temp dir.

Staging lives in ``<store>/tmp/oci-<random>/`` (the store's filesystem, so a staged
file can be linked into ``blobs/``) and is removed by ``aclose``. Its owner holds an ``flock`` on
``.lock`` inside it; a new stager removes every other ``oci-*`` directory whose lock
nobody holds (what a killed pull left behind). Peak disk use of a pull is about the
unpacked size of its new tar layers once (staged files become the blobs; a plain tar
layer's members are copied out, so twice) plus one compressed layer. Bound with the store's ``Space``, the stager reserves each layer's
compressed size before downloading it and its unpacked size (``unpacked_size``) before
unpacking it, so a pull that cannot fit fails with ``InsufficientSpace`` before those
bytes are written (the compressed reservation goes with the layer file, the unpacked one
with the staging directory at ``aclose``). The staged files the pull will link into
``blobs/`` are reserved by the pull's fill as well, so ``hand_off`` takes them off the
unpacked reservation once the snapshot's files are known (and a layer staged later, during
the fill, reserves only what the fill does not): the store counts them once.

Which revisions were built from a tar layer is kept beside the listings
(``record_users``: ``oci-layers/users-<digest>.json``); the store reads it when that
layer digest is revoked, to remove the snapshots unpacked from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from preheat.errors import (
    InsufficientSpace,
)
from preheat.images.client import RegistryClient
from preheat.images.manifest import Descriptor
from preheat.sources.oci_layer_fetch import Direct, LayerFetcher, first_failure
from preheat.sources.oci_layer_meta import unpacked_size, write_json
from preheat.sources.oci_layers import LayerDiff, Mode, scan_layer


class LayerStager:
    """Tar layers of one registry repository (see the module docstring)."""

    def __init__(self, client: RegistryClient, direct: Direct | None = None) -> None:
        self.client = client
        #: Whole layers into files, verified (``oci_layer_fetch``: spliced or streamed).
        self._fetch = LayerFetcher(client, direct)
        self._root: Path | None = None
        #: The store's ``Space`` (``bind_store``): staging is reserved in it.
        self._space: Any = None
        self._reservations: list[Any] = []
        self._staging: Path | None = None
        self._diffs: dict[str, LayerDiff] = {}
        self._staged: set[str] = set()
        #: sha256 -> (file, offset): where a staged member's bytes are (a plain tar
        #: layer's members stay inside the downloaded layer, not copied out).
        self._where: dict[str, tuple[Path, int]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock: int | None = None
        #: Unpacked-size reservations and the bytes each still counts (``hand_off``).
        self._unpacked: list[tuple[Any, list[int]]] = []
        #: sha256 -> size of staged files the fill reserves itself (``hand_off``); those
        #: in ``_covered`` are no longer counted by a staging reservation.
        self._handed: dict[str, int] = {}
        self._covered: set[str] = set()

    def bind_store(self, root: Path, space: Any = None) -> None:
        """Keep listings and staging in the store at ``root``; with its ``space``
        (``store.space.Space``), reserve what staging writes before writing it."""
        self._root = root
        self._space = space

    @property
    def root(self) -> Path | None:
        """The store this stager keeps listings in (None: unbound)."""
        return self._root

    def _listing(self, key: str) -> Path | None:
        return None if self._root is None else self._root / "oci-layers" / f"{key}.json"

    def staging(self) -> Path:
        if self._staging is None:
            if self._root is not None and (self._root / "tmp").is_dir():
                tmp = self._root / "tmp"
                staging = Path(tempfile.mkdtemp(prefix="oci-", dir=tmp))
            else:
                staging = Path(tempfile.mkdtemp(prefix="preheat-oci-"))
            self._lock = os.open(staging / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            self._staging = staging
            if self._root is not None:
                _sweep(staging.parent, staging)
        return self._staging

    def staged(self, sha256: str) -> tuple[Path, int]:
        """Where the bytes of the staged file ``sha256`` start: ``(file, offset)``."""
        return self._where.get(sha256) or (self.staging() / sha256, 0)

    async def diffs(
        self, layers: list[tuple[Descriptor, str, Mode, str]], parallel: int = 4
    ) -> list[LayerDiff]:
        """``diff`` of every ``(layer, compression, mode, where)``, ``parallel`` at a
        time (downloads overlap; unpacking runs in threads); the first failure cancels
        the rest."""
        gate = asyncio.Semaphore(parallel)

        async def one(d: Descriptor, comp: str, mode: Mode, where: str) -> LayerDiff:
            async with gate:
                return await self.diff(d, comp, mode, where)

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(*x)) for x in layers]
        except BaseExceptionGroup as eg:
            raise first_failure(eg) from None  # callers catch UnsafePath, ImageDigestMismatch...
        return [t.result() for t in tasks]

    async def diff(self, d: Descriptor, compression: str, mode: Mode, where: str) -> LayerDiff:
        """The layer's listing: remembered, else read from the store, else fetched."""
        key = f"{mode}-{d.hex}"
        if key in self._diffs:
            return self._diffs[key]
        path = self._listing(key)
        if path is not None:
            with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
                doc: Any = json.loads(await asyncio.to_thread(path.read_text))
                self._diffs[key] = LayerDiff.from_json(doc)
                return self._diffs[key]
        return await self.stage(d, compression, mode, where)

    async def stage(self, d: Descriptor, compression: str, mode: Mode, where: str) -> LayerDiff:
        """Fetch, verify and unpack the layer (once per source) and keep its listing."""
        key = f"{mode}-{d.hex}"
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key in self._staged:
                return self._diffs[key]
            staging = self.staging()
            blob = staging / f".layer-{d.hex}"
            download = await self._reserve(d.size, where, "downloaded")
            in_place: dict[str, int] = {}
            size = d.size
            try:
                await self._fetch.download(d, blob, where)
                if compression:  # a plain tar is read in place: nothing more is written
                    size = await asyncio.to_thread(unpacked_size, blob, compression, d.size)
                    reserved = max(0, size - self._credit(self._diffs.get(key)))
                    unpacked = await self._reserve(reserved, where, "unpacked")
                    self._reservations.append(unpacked)
                    if unpacked is not None:
                        self._unpacked.append((unpacked, [reserved]))
                diff = await asyncio.to_thread(
                    scan_layer,
                    blob,
                    d.media_type,
                    compression,
                    mode,
                    staging,
                    where,
                    in_place,
                    size,
                    lambda more: self._grow(more, where),
                )
            finally:
                if in_place:  # the layer file holds the members: kept until aclose
                    self._reservations.append(download)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        blob.unlink()
                    await self._release(download)
            for sha, offset in in_place.items():
                self._where.setdefault(sha, (blob, offset))
            self._diffs[key] = diff
            self._staged.add(key)
            path = self._listing(key)
            if path is not None:
                await asyncio.to_thread(write_json, path, diff.to_json())
            return diff

    async def hand_off(self, files: dict[str, int]) -> None:
        """The fill reserves these staged files (sha256 -> size) itself and links them
        into ``blobs/``: their bytes leave the staging reservations (now for those staged
        already, when staged for the rest), so the store counts them once. Not where the
        link cannot be made (staging on another filesystem): the fill copies them."""
        if self._space is None or self._root is None or not files:
            return
        try:
            same = os.stat(self.staging()).st_dev == os.stat(self._root / "blobs").st_dev
        except OSError:
            same = False
        if not same:
            return
        give = 0
        for sha, size in files.items():
            if sha in self._covered or sha in self._handed:
                continue
            if sha not in self._where and (self.staging() / sha).exists():
                self._covered.add(sha)
                give += size
            else:
                self._handed[sha] = size  # not staged yet: credited when it is
        await asyncio.to_thread(self._give, give)

    def on_disk(self, blobs: Mapping[str, int]) -> int:
        """Bytes of ``blobs`` (sha256 -> size) staged on the store's filesystem and handed
        off (``hand_off``): the fill links these, it does not write them."""
        return sum(size for sha, size in blobs.items() if sha in self._covered)

    def _credit(self, diff: LayerDiff | None) -> int:
        """Bytes of handed-off files that staging the layer of ``diff`` writes (not to be
        reserved again: the fill's reservation counts them)."""
        total = 0
        for m in diff.members if diff is not None else ():
            if m.kind == "file" and m.sha256 in self._handed and m.sha256 not in self._covered:
                self._covered.add(m.sha256)
                total += self._handed[m.sha256]
        return total

    def _give(self, n: int) -> None:
        """Take ``n`` bytes off the unpacked-size reservations (as far as they hold)."""
        for res, held in self._unpacked:
            if n <= 0:
                break
            take = min(n, held[0])
            if take:
                self._space.hand_over(res, take)
                held[0] -= take
                n -= take

    async def _reserve(self, need: int, where: str, what: str) -> Any:
        """Reserve ``need`` bytes of staging in the store (None when unbound); refused
        with ``InsufficientSpace`` naming the layer, before it is ``what``."""
        if self._space is None:
            return None
        try:
            return await asyncio.to_thread(self._space.reserve, f"{where} (staging)", need, ())
        except InsufficientSpace as exc:
            err = InsufficientSpace(
                f"{where}: the tar layer is staged under the store's tmp/ before its files "
                f"reach the store, and there is no room for it; nothing was {what}. {exc}"
            )
            err.need, err.free, err.evictable = exc.need, exc.free, exc.evictable
            raise err from None

    def _grow(self, more: int, where: str) -> None:
        """Reserve ``more`` bytes for a layer unpacking past its first estimate (in the
        unpacking thread; ``InsufficientSpace`` stops it before those bytes are written)."""
        if self._space is None:
            return
        try:
            res = self._space.reserve(f"{where} (staging)", more, ())
        except InsufficientSpace as exc:
            err = InsufficientSpace(
                f"{where}: the tar layer unpacks to more than its last gzip trailer says "
                f"(several members), and there is no room for the rest under the store's "
                f"tmp/; nothing more was unpacked and nothing was published. {exc}"
            )
            err.need, err.free, err.evictable = exc.need, exc.free, exc.evictable
            raise err from None
        self._reservations.append(res)
        self._unpacked.append((res, [more]))

    async def _release(self, reservation: Any) -> None:
        if reservation is not None:
            await asyncio.to_thread(self._space.release, reservation)

    async def aclose(self) -> None:
        if self._staging is not None:
            await asyncio.to_thread(shutil.rmtree, self._staging, True)
            self._staging = None
            self._staged.clear()
            self._where.clear()
        while self._reservations:
            await self._release(self._reservations.pop())
        self._unpacked.clear()
        self._handed.clear()
        self._covered.clear()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _sweep(tmp: Path, mine: Path, grace: float = 60.0) -> None:
    """Remove ``oci-*`` staging dirs under ``tmp`` whose owner is gone (lock free)."""
    for d in tmp.glob("oci-*"):
        if d == mine or not d.is_dir():
            continue
        try:
            fd = os.open(d / ".lock", os.O_RDWR)
        except FileNotFoundError:  # being created right now, or a crash before the lock
            with contextlib.suppress(OSError):
                if time.time() - d.stat().st_mtime > grace:
                    shutil.rmtree(d, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live pull owns it
        else:
            shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)
