"""preheat keeps large-model inference warm: node-local model caches and prefix-aware routing.

The public API is the few names below; everything else is implementation. Names load
lazily, so ``import preheat`` stays cheap and pulls in aiohttp, sqlite or boto3 only
when the matching feature is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "NodeStore": "preheat.store.store",
    "PullResult": "preheat.store.store",
    "EndpointSpec": "preheat.control.spec",
    "ClusterSpec": "preheat.control.spec",
    "load_endpoint": "preheat.control.spec",
    "load_cluster": "preheat.control.spec",
    "LocalFleet": "preheat.runtime.local",
    "Router": "preheat.router.server",
    "RouterConfig": "preheat.router.config",
    "KVCache": "preheat.kvcache",
    "get_profile": "preheat.timing",
    "StartRecord": "preheat.telemetry.events",
}

__all__ = [
    "ClusterSpec",
    "EndpointSpec",
    "KVCache",
    "LocalFleet",
    "NodeStore",
    "PullResult",
    "Router",
    "RouterConfig",
    "StartRecord",
    "__version__",
    "get_profile",
    "load_cluster",
    "load_endpoint",
]

if TYPE_CHECKING:
    from preheat.control.spec import ClusterSpec, EndpointSpec, load_cluster, load_endpoint
    from preheat.kvcache import KVCache
    from preheat.router.config import RouterConfig
    from preheat.router.server import Router
    from preheat.runtime.local import LocalFleet
    from preheat.store.store import NodeStore, PullResult
    from preheat.telemetry.events import StartRecord
    from preheat.timing import get_profile


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'preheat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
