"""Parsing of user-facing values shared by every edge (CLI options, YAML, HTTP bodies)."""

from __future__ import annotations

import re

from preheat.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse '10GiB', '500M', '1.5 GB' or a plain byte count into bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what} {text} is negative; give a byte count like 10GiB")
        return text
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what} {text!r} is not a size; write it like 500MiB, 10GiB or 2TB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """Bytes as a short human string with binary units: 1.5 GiB."""
    step = 1024.0
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < step or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= step
    raise AssertionError("unreachable")
