"""A prompt's token ids as a shared head and its own tail, without a copy (pure).

The fleet simulator's prompts are a memoised prefix (a family's system prompt, hundreds
of ids, one tuple shared by every request of the family) followed by a few ids of the
request's own. Joining them into one tuple per request costs a copy of the whole prefix
that the engine keeps for the request's life, though the scheduler reads only the
prompt's length and its last partial block (to hash the blocks its output fills). On
PyPy every such copy that is still in flight at a minor collection is copied out of the
nursery and traced pointer by pointer: ``JoinedTokens`` holds the two parts instead.

The fleet simulator passes its prefix tuple and the request's own ids as a list: PyPy
keeps a list's ints unboxed, while each id put into a new tuple is a boxed int, one more
object per id to copy out of the nursery. It is an immutable ``Sequence[int]``: ``len``,
indexing, slices (tuples), iteration and ``in`` behave as on ``head + tail``, so the
scheduler keeps it as it keeps a tuple.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain
from typing import overload

__all__ = ["JoinedTokens"]


class JoinedTokens(Sequence[int]):
    """``head + tail`` as a read-only sequence that shares both parts (tuples, or a list
    that the caller hands over and no longer changes); slices are tuples."""

    __slots__ = ("_len", "head", "tail")

    def __init__(self, head: Sequence[int], tail: Sequence[int]) -> None:
        self.head = head
        self.tail = tail
        self._len = len(head) + len(tail)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        head = self.head
        lh = len(head)
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return tuple(self)[i]
            if stop <= lh:
                return tuple(head[start:stop])
            if start >= lh:
                return tuple(self.tail[start - lh : stop - lh])
            return (*head[start:], *self.tail[: stop - lh])
        if i < 0:
            i += self._len
        if 0 <= i < lh:
            return head[i]
        if lh <= i < self._len:
            return self.tail[i - lh]
        raise IndexError("JoinedTokens index out of range")

    def __iter__(self) -> Iterator[int]:
        return chain(self.head, self.tail)

    def __contains__(self, value: object) -> bool:
        return value in self.tail or value in self.head

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (JoinedTokens, tuple)):
            return len(other) == self._len and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"JoinedTokens({self.head!r}, {self.tail!r})"

    def __reduce__(self) -> tuple[type[JoinedTokens], tuple[Sequence[int], Sequence[int]]]:
        return JoinedTokens, (self.head, self.tail)
