"""Gzip tar layers read whole (every member) within the space reserved for them.

A gzip file may hold several members back to back (``pigz -i``, ``bgzip``, ``cat a.gz
b.gz``); each ends with an ISIZE trailer (its length mod 2**32) that only says how much
*that* member unpacks to, and Python's ``tarfile`` ``r|gz`` stream stops after the first.
``GzipMembers`` decompresses every member in turn (zlib checks each member's CRC-32 and
ISIZE at its end) and never hands out more than its ``budget``: the bytes the stager
reserved from the last trailer. When the stream runs past that, the true length is
counted first (``count``: decompressed, nothing written), the reservation grown by the
difference (``grow``, which refuses with ``InsufficientSpace`` when there is no room),
and only then does unpacking go on. A member whose trailer lies is refused by zlib at its
end (the counting pass reaches it before anything past the budget is written), so a
layer never stages more than the store agreed to hold.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import IO

__all__ = ["GzipMembers", "count"]

_READ = 4 << 20
_GZIP = 16 + zlib.MAX_WBITS  # gzip header and trailer, checked by zlib


def count(fd: int, size: int) -> int:
    """The decompressed length of every member of the gzip file ``fd`` (``size`` bytes),
    read with ``pread``; a corrupt stream or a lying trailer raises ``zlib.error`` and a
    truncated one ``EOFError``."""
    total, pos = 0, 0
    d = zlib.decompressobj(_GZIP)
    pending = b""
    while True:
        if d.eof:
            pending = d.unused_data
            if not pending and pos >= size:
                return total
            d = zlib.decompressobj(_GZIP)
        if not pending:
            pending = os.pread(fd, min(_READ, size - pos), pos)
            pos += len(pending)
            if not pending:
                raise EOFError("the gzip stream ended inside a member")
        total += len(d.decompress(pending, _READ))
        pending = d.unconsumed_tail


class GzipMembers:
    """A file-like reader of the decompressed bytes of every member of the gzip file
    ``f`` (``size`` bytes), at most ``budget`` of them before ``grow(more)`` has reserved
    more (see the module docstring)."""

    def __init__(self, f: IO[bytes], size: int, budget: int, grow: Callable[[int], None]) -> None:
        self._f = f
        self._size = size
        self._budget = budget
        self._grow = grow
        self._counted = False
        self._d = zlib.decompressobj(_GZIP)
        self._pending = b""
        self._out = 0
        self._buf = memoryview(b"")

    def read(self, n: int = -1) -> bytes:
        while not self._buf:
            chunk = self._next()
            if not chunk:
                return b""
            self._buf = memoryview(chunk)
        n = len(self._buf) if n < 0 else n
        out, self._buf = self._buf[:n], self._buf[n:]
        return out.tobytes()

    def _next(self) -> bytes:
        while True:
            if self._d.eof:
                self._pending = self._d.unused_data
                if not self._pending:
                    self._pending = self._f.read(_READ)
                    if not self._pending:
                        return b""
                self._d = zlib.decompressobj(_GZIP)
            if not self._pending:
                self._pending = self._f.read(_READ)
                if not self._pending:
                    raise EOFError("the gzip stream ended inside a member")
            out = self._d.decompress(self._pending, _READ)
            self._pending = self._d.unconsumed_tail
            if out:
                self._spend(len(out))
                return out

    def _spend(self, n: int) -> None:
        self._out += n
        if self._out <= self._budget:
            return
        if self._counted:  # the counted length is exact: the bytes changed under us
            raise zlib.error(f"the gzip stream unpacks past the {self._budget} bytes counted")
        self._counted = True
        total = count(self._f.fileno(), self._size)
        if total > self._budget:
            self._grow(total - self._budget)
            self._budget = total
        if self._out > self._budget:
            raise zlib.error(f"the gzip stream unpacks past the {self._budget} bytes counted")
