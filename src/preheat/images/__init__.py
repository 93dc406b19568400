"""Container images: an OCI distribution client and the node image cache (docs/images.md).

from preheat.images import ImageCache
cache = ImageCache(NodeStore("/var/lib/preheat/node-a"))
result = cache.pull("registry.example:5000/team/app:v1")
cache.ref(result.digest, "chat")   # never evicted while referenced

The names load lazily: the registry client (``images.client``) sits below ``sources``
(``sources.oci`` uses it) while the cache sits above ``store``, so importing this
package must not import the cache.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "ImageCache": "preheat.images.cache",
    "ImageInfo": "preheat.images.cache",
    "ImagePull": "preheat.images.cache",
    "ImageRef": "preheat.images.reference",
    "Platform": "preheat.images.reference",
    "parse_image_ref": "preheat.images.reference",
    "parse_platform": "preheat.images.reference",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'preheat.images' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
