"""The one poll-until helper of the Kubernetes tests (and :meth:`KubeCluster.wait_for`).

A check against the API server or a process on 127.0.0.1 is often briefly unanswerable
(a 409 while a controller writes, a connection refused while a process starts, a key
not there yet): :func:`until` treats the usual exceptions of such a check as "not yet"
and keeps polling, bounded in time, then fails naming what it waited for and the last
value or exception it saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["NOT_YET", "until"]

T = TypeVar("T")

#: Exceptions that mean "not yet" while polling: the server or process is not answering
#: yet (OSError), a Rest.get/must saw a non-2xx status (RuntimeError), or a field is not
#: written yet (KeyError, IndexError).
NOT_YET: tuple[type[BaseException], ...] = (OSError, RuntimeError, KeyError, IndexError)


def until(
    what: str,
    fn: Callable[[], T | None],
    timeout: float = 60.0,
    *,
    interval: float = 0.2,
    not_yet: tuple[type[BaseException], ...] = NOT_YET,
) -> T:
    """Poll ``fn`` every ``interval`` seconds until it returns something truthy (returned);
    an exception in ``not_yet`` counts as a falsy answer. Raise AssertionError naming
    ``what`` and the last answer after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            out = fn()
            if out:
                return out
            last = out
        except not_yet as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not true within {timeout:g} s (last: {last!r})")
        time.sleep(interval)
