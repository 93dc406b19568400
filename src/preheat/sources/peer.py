"""Fetching pieces of a blob from peers, verified, with the origin as the last resort.

``PeerFill`` plugs into the store's fill (``FillContext.peers``): for each range (one
piece, ``store.pieces.PIECE_SIZE``) of a blob with a known sha256 it asks the
``PeerDirectory`` for the peers that hold that piece, best first (least busy serving,
then rendezvous order: the pieces of one blob spread over several peers at once), and
fetches the piece from the first that delivers it:

- the piece list comes from a holder (``GET /blobs/sha256:<hex>/pieces``) and must fit
  the blob (size, piece size, count); the piece's bytes are written at their offsets
  but count as written for the blob's hasher only once their sha256 matches the list,
  so a bad piece never reaches the blob's digest and is fetched again elsewhere;
- a peer that serves bytes that do not match is *avoided* by the whole cluster
  (``PeerDirectory.avoid``); one that fails (refused, reset mid-transfer, 5xx, slow)
  is skipped for this blob; then the next peer is tried, then the origin;
- a verified piece is recorded in the node's ``PieceBook``, so this node serves it to
  other peers while its own fill runs;
- with ``wait_for_seeds`` (a fill the fan-out sent to peers, ``control.fanout``), a
  piece no peer holds yet while a *seed* fills the blob from the origin (the directory's
  ``seed_progress``) is waited for: the fill polls until the seed lands it, and goes to
  the origin for it only when the seed lands no piece of the blob for ``seed_stall``
  seconds (``seed_stalls`` counts those pieces) or stops filling (failed, lost: gone
  from the directory for ``seed_gone`` seconds, so a late read is not a loss). An
  origin fill never waits (seeds never wait on each other);
- the blob is still checked against the manifest's sha256 at the end (``store.fill``),
  as from any origin: a mismatch there makes every peer that supplied the list or a
  piece of it avoided (``blob_failed``), and the next attempt uses the origin.

Blobs without a sha256 (a single-file URL) are not digest-addressed: origin only.
The cluster token goes in the ``Authorization`` header only, never in a URL or message.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from preheat.control.fanout import Candidate, rank_peers
from preheat.errors import FetchError
from preheat.sources import _splice
from preheat.sources.pieces import PieceBook, blob_path, piece_count

if TYPE_CHECKING:
    from preheat.store.fill import FillContext

__all__ = ["PeerClient", "PeerDirectory", "PeerFill", "PieceMismatch", "SeedDirectory"]


class PieceMismatch(ValueError):
    """A peer's bytes for a piece do not match the piece list."""


class PeerDirectory(Protocol):
    """Who holds what (the fleet's nodes in local mode; NodeCache objects in Kubernetes)."""

    def candidates(self, digest: str, index: int, receiver: str) -> Sequence[tuple[str, str]]:
        """(peer name, base URL) of peers holding piece ``index`` of ``digest``, best
        first, without ``receiver`` and without avoided peers."""
        ...

    def avoid(self, peer: str, why: str) -> None:
        """Stop using ``peer`` (it served bytes that failed verification)."""
        ...


class SeedDirectory(PeerDirectory, Protocol):
    """A directory that also knows which nodes are filling a blob from the origin."""

    def seed_progress(self, digest: str, receiver: str) -> dict[str, int]:
        """The up nodes (not ``receiver``) filling ``digest`` from the origin now, each
        with the number of its pieces landed so far (empty: nobody is filling it)."""
        ...


#: Seconds between looks while a piece waits for a seed.
SEED_POLL = 0.1


class PeerClient:
    """HTTP to peers with the cluster token (one pooled session, shared by fills)."""

    def __init__(self, token: str, *, connections: int = 64, read_timeout: float = 10.0) -> None:
        self._headers = {"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"}
        self._connections = connections
        self._read_timeout = read_timeout
        self._session: aiohttp.ClientSession | None = None
        self._pools: dict[tuple[str, int], _splice.SplicePool] = {}

    def pool(self, base: str) -> _splice.SplicePool | None:
        """Keep-alive splice(2) connections to a peer (None where splice is missing)."""
        if not _splice.AVAILABLE:
            return None
        parts = urlsplit(base)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _splice.SplicePool(*key)
        return pool

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections),
                timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=self._read_timeout),
                auto_decompress=False,
                read_bufsize=1 << 20,
            )
        return self._session

    @property
    def headers(self) -> dict[str, str]:
        return self._headers

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def piece_list(self, base: str, digest: str) -> dict[str, Any] | None:
        """A holder's piece list for ``digest``, or None when it cannot give one."""
        try:
            async with self.session().get(
                f"{base}{blob_path(digest)}/pieces", headers=self._headers
            ) as resp:
                if resp.status != 200:
                    return None
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return data if isinstance(data, dict) else None


@dataclass
class PeerFill:
    """The peer side of one pull into node ``receiver`` (see the module docstring)."""

    client: PeerClient
    directory: PeerDirectory
    receiver: str
    book: PieceBook
    #: Bytes that came from peers / pieces that failed verification, for this pull.
    peer_bytes: int = 0
    bad_pieces: int = 0
    peer_failures: int = 0
    #: Wait for a seed's pieces (a fill the fan-out sent to peers), up to ``seed_stall``
    #: seconds without progress; ``seed_stalls``: pieces that went to the origin instead.
    wait_for_seeds: bool = False
    seed_stall: float = 20.0
    seed_stalls: int = 0
    #: Seconds a piece still waits after its seed left the directory (a renewal late, or
    #: the seed's last status read before its slot freed) before it goes to the origin.
    seed_gone: float = 3.0
    _lists: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    _failed: dict[str, set[str]] = field(default_factory=dict)
    _sources: dict[str, set[str]] = field(default_factory=dict)

    async def fetch_range(
        self,
        ctx: FillContext,
        prog: Any,
        fd: int,
        index: int,
        start: int,
        end: int,
        digest: str | None,
        origin: Callable[[], Awaitable[None]],
    ) -> None:
        """Fill piece ``index`` ([start, end)) of the blob ``digest``: from peers when one
        holds it and delivers verified bytes, else through ``origin()``."""
        if digest is not None and prog.filled[index] == 0:
            seeds = getattr(self.directory, "seed_progress", None)
            loop = asyncio.get_running_loop()
            last, since, gone = -1, loop.time(), None
            while True:
                seen = self._seeds(seeds, digest) if self.wait_for_seeds else None
                if await self._from_peers(ctx, prog, fd, index, start, end, digest):
                    return
                now = loop.time()
                if seen is None:
                    if last < 0:
                        break  # nobody is filling it: the origin serves this piece
                    # the seed left the directory: it finished (its blob shows complete at
                    # the next read) or stopped (failed, lost); ``seed_gone`` tells which
                    gone = now if gone is None else gone
                    if now - gone > self.seed_gone:
                        break
                elif seen != last:
                    last, since, gone = seen, now, None
                elif now - since > self.seed_stall:
                    self.seed_stalls += 1
                    break  # the seed stalled: this piece comes from the origin
                else:
                    gone = None
                await asyncio.sleep(SEED_POLL)
        await origin()
        if digest is not None and prog.filled[index] >= end - start:
            # served to peers while this fill runs (pieces.PieceBook.landed)
            landed = await asyncio.get_running_loop().run_in_executor(
                ctx.executor, _hash_range, fd, start, end
            )
            self.book.landed(digest, prog.size, prog.chunk, index, landed)

    def _seeds(self, seeds: Any, digest: str) -> int | None:
        """Pieces landed by the seeds of ``digest`` this fill may still use (None: none)."""
        if seeds is None:
            return None
        failed = self._failed.get(digest, set())
        live = {n: k for n, k in seeds(digest, self.receiver).items() if n not in failed}
        return sum(live.values()) if live else None

    async def _from_peers(
        self, ctx: FillContext, prog: Any, fd: int, index: int, start: int, end: int, digest: str
    ) -> bool:
        """Piece ``index`` from the first peer that holds it and delivers verified bytes."""
        failed = self._failed.setdefault(digest, set())
        for name, base in self.directory.candidates(digest, index, self.receiver):
            if name in failed:
                continue
            digests = await self._digests(digest, prog.size, prog.chunk, name, base)
            if digests is not None and not digests[index]:
                continue  # a seed filling from the origin has not landed this piece
            if digests is None:
                self.peer_failures += 1
                failed.add(name)
                continue
            try:
                await self._from_peer(ctx, prog, fd, index, start, end, digest, digests, base)
            except PieceMismatch as exc:
                self.bad_pieces += 1
                failed.add(name)
                self.directory.avoid(name, str(exc))
                continue
            except (aiohttp.ClientError, TimeoutError, ConnectionError, _PeerRefused):
                self.peer_failures += 1
                failed.add(name)
                continue
            self._sources.setdefault(digest, set()).add(name)
            return True
        return False

    async def _digests(
        self, digest: str, size: int, chunk: int, name: str, base: str
    ) -> tuple[str, ...] | None:
        known = self._lists.get(digest)
        if known is not None and all(known[0]):
            return known[0]
        data = await self.client.piece_list(base, digest)
        if data is None:
            return None
        digests = data.get("digests")
        if (
            data.get("size") != size
            or data.get("piece") != chunk
            or not isinstance(digests, list)
            or len(digests) != piece_count(size, chunk)
            or not all(isinstance(d, str) and len(d) in (0, 64) for d in digests)
        ):
            return None  # not this blob, or another piece size: the origin serves it
        listed = tuple(digests)
        self._lists[digest] = (listed, name)
        self.book.start(digest, size, chunk, listed)
        return listed

    async def _from_peer(
        self,
        ctx: FillContext,
        prog: Any,
        fd: int,
        index: int,
        start: int,
        end: int,
        digest: str,
        digests: tuple[str, ...],
        base: str,
    ) -> None:
        """Move the piece into ``fd`` (splice(2): the kernel moves the pages), then hash
        it from the page cache in a worker thread before it counts as written."""
        n = end - start
        if ctx.limiter is not None:
            await ctx.limiter.take(n)  # the node's link, one piece at a time
        pool = self.client.pool(base)
        if pool is not None:
            try:
                await pool.get_range(
                    blob_path(digest),
                    start,
                    end,
                    fd,
                    lambda _offset, _n: None,
                    f"peer {base}",
                    headers={"Authorization": self.client.headers["Authorization"]},
                    check=_need_206,
                )
            except (FetchError, _splice.Unsupported) as exc:
                raise _PeerRefused(str(exc)) from None
        else:
            await self._stream(fd, start, end, digest, base)
        actual = await asyncio.get_running_loop().run_in_executor(
            ctx.executor, _hash_range, fd, start, end
        )
        if actual != digests[index]:
            raise PieceMismatch(
                f"piece {index} of blob {digest[:16]} has sha256 {actual[:16]}, the piece "
                f"list says {digests[index][:16]}"
            )
        self.peer_bytes += n
        ctx.stats.fetched += n
        prog.wrote(index, n)
        if ctx.on_bytes is not None:
            ctx.on_bytes(n)
        self.book.verified(digest, index)

    async def _stream(self, fd: int, start: int, end: int, digest: str, base: str) -> None:
        """The piece through aiohttp (no splice(2) on this platform)."""
        pos = start
        headers = {**self.client.headers, "Range": f"bytes={start}-{end - 1}"}
        async with self.client.session().get(f"{base}{blob_path(digest)}", headers=headers) as r:
            if r.status != 206:
                raise _PeerRefused(f"peer answered {r.status}")
            async for data in r.content.iter_any():
                view = memoryview(data)[: end - pos]
                written = 0
                while written < len(view):
                    written += os.pwrite(fd, view[written:], pos + written)
                pos += len(view)
                if pos >= end:
                    break
        if pos < end:
            raise _PeerRefused(f"peer's body ended at byte {pos}, expected {end}")

    def blob_failed(self, digest: str) -> None:
        """The blob's sha256 did not match after a fill that used peers: every peer
        that supplied its piece list or a piece is avoided, and its list forgotten."""
        listed = self._lists.pop(digest, None)
        blamed = set(self._sources.pop(digest, set()))
        if listed is not None:
            blamed.add(listed[1])
        for name in sorted(blamed):
            self.directory.avoid(name, f"blob {digest[:16]} failed verification")
        self.book.finish(digest)

    def blob_done(self, digest: str | None) -> None:
        """The fill of ``digest`` ended either way: it is no longer served from tmp/."""
        if digest is not None:
            with contextlib.suppress(KeyError):
                self.book.finish(digest)


def _need_206(status: int, headers: Mapping[str, str]) -> None:
    if status != 206:
        raise _PeerRefused(f"peer answered {status}")


def _hash_range(fd: int, start: int, end: int) -> str:
    """sha256 of bytes [start, end) of ``fd`` (a worker thread; hashlib drops the GIL)."""
    h = hashlib.sha256()
    pos = start
    while pos < end:
        data = os.pread(fd, min(8 << 20, end - pos), pos)
        if not data:
            break
        h.update(data)
        pos += len(data)
    return h.hexdigest()


class _PeerRefused(Exception):
    """A peer did not deliver the range (not held, not verified yet, cut short)."""


class PeerList:
    """A ``PeerDirectory`` over a fixed set of peers that may hold a blob (e.g. what
    Kubernetes ``NodeCache`` objects list): every peer is a candidate for every piece, in
    rendezvous order per piece; one that lacks it answers 404 and is skipped."""

    def __init__(self, peers: dict[str, str]) -> None:
        self.peers = dict(peers)
        self.avoided: dict[str, str] = {}

    def candidates(self, digest: str, index: int, receiver: str) -> list[tuple[str, str]]:
        others = [Candidate(n) for n in self.peers if n != receiver]
        ranked = rank_peers(others, f"{digest}:{index}", frozenset(self.avoided))
        return [(n, self.peers[n]) for n in ranked]

    def avoid(self, peer: str, why: str) -> None:
        self.avoided[peer] = why
