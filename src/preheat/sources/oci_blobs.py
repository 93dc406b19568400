"""Blob fetching shared by every registry-backed source (``oci://`` models and the image
cache's ``images.source``): small files served from memory, blobs by ranged GETs on the
fill's zero-copy splice path, or ``RegistryClient.blob`` when that path cannot serve
(TLS, redirects, a token to renew).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, Callable, Mapping
from urllib.parse import urlsplit

from preheat.artifacts.refs import redact_url
from preheat.images.client import RegistryClient
from preheat.sources import _splice
from preheat.sources.base import Location, Unsupported

__all__ = ["RegistryBlobSource"]


class RegistryBlobSource:
    """Blob fetching shared by registry-backed sources (see the module docstring)."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client
        self._memory: dict[str, bytes] = {}
        self._pools: dict[tuple[str, int], _splice.SplicePool] = {}
        self._splice_ok = True

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        await self.client.aclose()

    def can_direct(self, location: Location) -> bool:
        return (
            _splice.AVAILABLE
            and self._splice_ok
            and location.url not in self._memory
            and location.url.startswith("http://")
        )

    async def fetch_to_fd(
        self,
        location: Location,
        start: int,
        end: int,
        fd: int,
        on_bytes: Callable[[int, int], None],
    ) -> None:
        parts = urlsplit(location.url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _splice.SplicePool(*key)
        shown = redact_url(location.url)
        try:
            await pool.get_range(
                parts.path,
                start,
                end,
                fd,
                on_bytes,
                shown,
                headers=await self.client.auth_headers(),
                check=functools.partial(_needs_client, shown),
            )
        except Unsupported:
            self._splice_ok = False  # redirects, a token to renew: the full client
            raise

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        data = self._memory.get(location.url)
        if data is not None:
            yield data[start:end]
            return
        async for chunk in self.client.blob(location.url, start, end):
            yield chunk


def _needs_client(shown: str, status: int, headers: Mapping[str, str]) -> None:
    if status in (301, 302, 303, 307, 308, 401):
        raise Unsupported(f"{shown}: HTTP {status} needs the full client")
