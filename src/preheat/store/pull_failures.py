"""A pull's failures: one error that names every file that failed, and disk-full
detection (a full disk becomes ``InsufficientSpace`` in ``store.pull``)."""

from __future__ import annotations

import asyncio
import errno

__all__ = ["disk_full", "one_error"]


def disk_full(exc: BaseException) -> bool:
    leaves = [exc]
    while leaves:
        e = leaves.pop()
        if isinstance(e, BaseExceptionGroup):
            leaves.extend(e.exceptions)
        elif (
            isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        ) or "disk is full" in str(e):
            return True
    return False


def one_error(eg: BaseExceptionGroup[BaseException], files: dict[int, str]) -> BaseException:
    """The first failure, its message listing every file that failed and why (callers
    keep catching the first failure's type; ``.failures`` holds (path, error) pairs)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    errors = [e for e in leaves if not isinstance(e, asyncio.CancelledError)] or leaves
    first = errors[0]
    pairs = [(files.get(id(e), "?"), e) for e in errors]
    if len(errors) > 1:
        listed = "; ".join(f"{p!r}: {type(e).__name__}: {e}" for p, e in pairs)
        first.args = (f"{len(errors)} files failed: {listed}",)
    first.failures = pairs  # type: ignore[attr-defined]
    return first
