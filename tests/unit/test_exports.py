"""The public API is exactly what we meant to export."""

from __future__ import annotations

import preheat


def test_public_names() -> None:
    """Every name in __all__ exists, and nothing private is exported."""
    for name in preheat.__all__:
        assert hasattr(preheat, name), name
        assert not name.startswith("_") or name == "__version__"
