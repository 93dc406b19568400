"""Pieces: the unit peers exchange, and which pieces of a fill in progress are verified.

A blob is cut into ``PIECE_SIZE`` pieces (the last one shorter). A blob's *piece list*
is the sha256 of each piece, computed from the complete blob after its own sha256 was
verified (``piece_digests``); peers hand it out with the blob (``GET
/blobs/sha256:<hex>/pieces``).

Why pieces are verified against a list: a blob has one sha256, so no part of a blob
can be checked before all of it is there. A node filling
from peers holds the piece list and checks every piece against it as the piece lands,
before the piece counts as written; those pieces, and only those, are *verified* and
it serves them to other peers while its fill runs (``PieceBook``). A node filling *from
the origin* serves each piece once it has landed, under the sha256 of its bytes as they
landed (``PieceBook.landed``): a receiver checks its pieces against that list, which is
only as good as the seed's origin bytes. The whole blob is still checked against the
manifest's sha256 at the end, as from any origin: a piece list that lied (or a seed's
corrupt origin bytes) fails there, its sender is avoided and the origin is used.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

__all__ = ["PIECE_SIZE", "PartialBlob", "PieceBook", "blob_path", "piece_count", "piece_digests"]

#: Bytes per piece; a fill that may use peers uses it as its range size.
PIECE_SIZE = 16 << 20


def blob_path(digest: str) -> str:
    """The URL path of a blob on a peer server (``store.peer_server``)."""
    return f"/blobs/sha256:{digest}"


def piece_count(size: int, piece: int = PIECE_SIZE) -> int:
    return max(1, -(-size // piece))


def piece_digests(path: os.PathLike[str] | str, size: int, piece: int = PIECE_SIZE) -> list[str]:
    """sha256 of each piece of a complete file (blocking: run it in a thread)."""
    out = []
    with open(path, "rb", buffering=0) as f:
        for _ in range(piece_count(size, piece)):
            h = hashlib.sha256()
            left = piece
            while left > 0:
                data = f.read(min(left, 4 << 20))
                if not data:
                    break
                h.update(data)
                left -= len(data)
            out.append(h.hexdigest())
    return out


@dataclass
class PartialBlob:
    """One blob a node is filling from peers: its piece list and the pieces verified."""

    size: int
    piece: int
    digests: tuple[str, ...]
    verified: set[int] = field(default_factory=set)

    def covers(self, start: int, end: int) -> bool:
        """Whether every byte of [start, end) lies in verified pieces."""
        if start >= end:
            return False
        first, last = start // self.piece, (end - 1) // self.piece
        return all(i in self.verified for i in range(first, last + 1))


class PieceBook:
    """A node's fills in progress from peers (digest -> ``PartialBlob``); lives on the
    event loop that runs the node's fills and its peer server."""

    def __init__(self) -> None:
        self._blobs: dict[str, PartialBlob] = {}

    def start(self, digest: str, size: int, piece: int, digests: tuple[str, ...]) -> PartialBlob:
        entry = self._blobs.get(digest)
        if entry is not None and (entry.size, entry.piece) == (size, piece):
            pairs = list(zip(entry.digests, digests, strict=False))
            if len(pairs) == len(digests) and all(a == b or not a or not b for a, b in pairs):
                # the same list, or one that names more pieces (a seed still filling)
                entry.digests = tuple(a or b for a, b in pairs)
                return entry
        entry = self._blobs[digest] = PartialBlob(size, piece, digests)
        return entry

    def landed(self, digest: str, size: int, piece: int, index: int, sha256: str) -> None:
        """Piece ``index`` of a fill *from the origin* is on disk with this sha256 (hashed
        from the bytes as they landed): it is served under that piece digest while the
        fill runs (``""`` in the list marks pieces not landed yet). A piece whose digest a
        peer's list gave already counts only when it matches."""
        entry = self._blobs.get(digest)
        if entry is None:
            n = -(-size // piece) if size else 1
            entry = self._blobs[digest] = PartialBlob(size, piece, ("",) * n)
        if entry.size != size or entry.piece != piece or not 0 <= index < len(entry.digests):
            return
        known = entry.digests[index]
        if known == "":
            entry.digests = (*entry.digests[:index], sha256, *entry.digests[index + 1 :])
        elif known != sha256:
            return
        entry.verified.add(index)

    def verified(self, digest: str, index: int) -> None:
        entry = self._blobs.get(digest)
        if entry is not None:
            entry.verified.add(index)

    def get(self, digest: str) -> PartialBlob | None:
        return self._blobs.get(digest)

    def progress(self) -> dict[str, tuple[int, frozenset[int]]]:
        """digest -> (piece count, verified pieces) of every fill in progress: a copy,
        safe to read from another thread (a status writer) while fills run."""
        return {d: (len(e.digests), frozenset(e.verified)) for d, e in list(self._blobs.items())}

    def finish(self, digest: str) -> None:
        """The fill ended (published, failed or cancelled): nothing of it is served from
        ``tmp/`` any more (a published blob is served from ``blobs/``)."""
        self._blobs.pop(digest, None)
