"""preheat keeps large-model inference warm: node-local model caches and prefix-aware routing.

The public API is the few names below; everything else is implementation.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
