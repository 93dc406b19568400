"""Container images: an OCI distribution client and the node image cache (docs/images.md).

from preheat.images import ImageCache
cache = ImageCache(NodeStore("/var/lib/preheat/node-a"))
result = cache.pull("registry.example:5000/team/app:v1")
cache.ref(result.digest, "endpoint/chat")   # never evicted while referenced
"""

from preheat.images.cache import ImageCache, ImageInfo, ImagePull
from preheat.images.reference import ImageRef, Platform, parse_image_ref, parse_platform

__all__ = [
    "ImageCache",
    "ImageInfo",
    "ImagePull",
    "ImageRef",
    "Platform",
    "parse_image_ref",
    "parse_platform",
]
