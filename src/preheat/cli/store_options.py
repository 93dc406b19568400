"""The store commands' shared pieces (``preheat cache``, ``preheat image``): the
``--store``/``--capacity``/``--high-watermark`` options, opening the store, and errors as
one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from preheat.config import parse_size
from preheat.errors import PreheatError

__all__ = ["STORE_HELP", "click_errors", "open_store", "store_option"]

STORE_HELP = "Store directory (created if missing); also read from $PREHEAT_STORE."


def store_option(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--capacity",
        default=None,
        metavar="SIZE",
        help="Most the store may hold, e.g. 200GiB; fills stay under SIZE x --high-watermark. "
        "Default: bounded only by free disk space.",
    )(f)
    f = click.option(
        "--high-watermark",
        type=click.FloatRange(0.01, 1.0),
        default=0.9,
        show_default=True,
        help="Fraction of --capacity that fills may use before eviction kicks in.",
    )(f)
    return click.option(
        "--store",
        "store_dir",
        required=True,
        envvar="PREHEAT_STORE",
        type=click.Path(file_okay=False, path_type=Path),
        help=STORE_HELP,
    )(f)


def open_store(store_dir: Path, capacity: str | None, high_watermark: float) -> Any:
    from preheat.store import NodeStore

    cap = parse_size(capacity, what="--capacity") if capacity else None
    return NodeStore(store_dir, capacity=cap, high_watermark=high_watermark)


@contextmanager
def click_errors() -> Iterator[None]:
    """Preheat errors become one clear line and exit code 1 (no traceback)."""
    try:
        yield
    except PreheatError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
