"""What the fleet says: the last lines for status, every line in ``<state>/logs/fleet.log``.

``say`` is for the operator (status messages, the `preheat up` console); ``error`` is
for what should never happen (an unexpected exception in the reconcile loop or a
background task): it writes the traceback to the log file and to the ``preheat.fleet``
logger, and says a one-line summary. Every line passes ``redact_url`` first, so a
credential in a source URL (userinfo, a presigned query string) never reaches a
message, the log file or the logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections import deque
from pathlib import Path
from typing import TextIO

from preheat.artifacts.refs import redact_url

__all__ = ["REPEAT_WINDOW", "FleetLog"]

logger = logging.getLogger("preheat.fleet")

#: Seconds during which the same unexpected error is counted, not logged again.
REPEAT_WINDOW = 60.0


class FleetLog:
    """The fleet's messages: ``messages`` keeps the last ``keep``, the file keeps all."""

    def __init__(self, path: Path | None, *, keep: int = 30) -> None:
        self.path = path
        self.messages: deque[str] = deque(maxlen=keep)
        #: Messages said so far (``messages`` keeps only the last ``keep``).
        self.said = 0
        #: Unexpected exceptions logged with a traceback (reconcile loop, tasks).
        self.errors = 0
        self._file: TextIO | None = None
        self._last_error: tuple[str, float] | None = None
        self._repeats = 0

    def _write(self, line: str) -> None:
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8", buffering=1)
        self._file.write(line + "\n")

    def say(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {redact_url(text)}"
        self.messages.append(line)
        self.said += 1
        try:
            self._write(line)
        except OSError as exc:  # a full disk must not stop the fleet
            logger.warning("cannot write %s: %s", self.path, exc)

    def error(self, what: str, exc: BaseException) -> None:
        """An unexpected exception: one line in status, the traceback in the log. The
        same error again within ``REPEAT_WINDOW`` seconds is only counted (a fault that
        persists across ticks must not fill the disk)."""
        self.errors += 1
        summary = redact_url(f"{what}: {type(exc).__name__}: {exc}")
        now = time.monotonic()
        if self._last_error is not None:
            last, since = self._last_error
            if last == summary and now - since < REPEAT_WINDOW:
                self._repeats += 1
                return
            if self._repeats:
                self.say(f"the previous error repeated {self._repeats} more time(s)")
        self._last_error = (summary, now)
        self._repeats = 0
        trace = redact_url("".join(traceback.format_exception(exc)))
        self.say(f"{summary} (traceback in {self.path or 'the log'})")
        logger.error("%s\n%s", summary, trace.rstrip())
        with contextlib.suppress(OSError):
            self._write(trace.rstrip())

    def watch(self, task: asyncio.Task[None], what: str) -> asyncio.Task[None]:
        """Log ``task``'s unexpected exception with its traceback when it ends."""

        def done(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                assert exc is not None
                self.error(what, exc)

        task.add_done_callback(done)
        return task

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
