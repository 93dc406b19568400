"""Active health checks of the router's instances.

Every ``health.interval_s`` seconds each instance gets ``GET health.path`` (timeout
``health.timeout_s``): a status below 500 is a pass. ``health.failures`` consecutive
failures mark a healthy instance unhealthy; one pass marks an unhealthy one healthy
again. Draining instances are probed but never change state here. The settings are
read each round, so ``PUT /admin/config`` changes them live.
"""

from __future__ import annotations

import asyncio

import aiohttp

from preheat.router.state import RoutingState, Upstream


class HealthChecker:
    """Probes every instance of ``state`` through ``session``."""

    def __init__(self, state: RoutingState, session: aiohttp.ClientSession) -> None:
        self.state = state
        self.session = session

    async def check(self, up: Upstream) -> None:
        h = self.state.config.health
        try:
            async with self.session.get(
                up.id + h.path, timeout=aiohttp.ClientTimeout(total=h.timeout_s)
            ) as resp:
                await resp.read()
                ok = resp.status < 500
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            up.failures = 0
            if up.state == "unhealthy":
                self.state.set_state(up, "healthy")
        else:
            up.failures += 1
            if up.state == "healthy" and up.failures >= h.failures:
                self.state.set_state(up, "unhealthy")

    async def run(self) -> None:
        """Probe forever, one round per interval (cancel the task to stop)."""
        while True:
            await asyncio.sleep(self.state.config.health.interval_s)
            await asyncio.gather(*(self.check(u) for u in self.state.upstreams()))
