"""Active health checks of the router's instances.

Every ``health.interval_s`` seconds each instance gets ``GET health.path`` (timeout
``health.timeout_s``): a status below 500 is a pass. ``health.failures`` consecutive
failures mark a healthy instance unhealthy; one pass marks an unhealthy one healthy
again. Draining instances are probed but never change state here. The settings are
read each round, so ``PUT /admin/config`` changes them live.

Error handling: a connection error or timeout is a failed check. Anything unexpected
inside a probe (a bug, a client library raising what it should have wrapped) is a
failed check too, logged with its traceback once per instance and kind of error (again
after the instance passes a check); the loop never stops for it. Each probe runs on its
own, so one instance's fault does not cancel the others' checks.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from preheat.router.state import RoutingState, Upstream

log = logging.getLogger("preheat.router")


class HealthChecker:
    """Probes every instance of ``state`` through ``session``."""

    def __init__(self, state: RoutingState, session: aiohttp.ClientSession) -> None:
        self.state = state
        self.session = session
        self._reported: set[tuple[str, str]] = set()

    async def _probe(self, up: Upstream) -> bool:
        h = self.state.config.health
        try:
            async with self.session.get(
                up.id + h.path, timeout=aiohttp.ClientTimeout(total=h.timeout_s)
            ) as resp:
                await resp.read()
                return resp.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False
        except Exception as exc:
            key = (up.id, type(exc).__name__)
            if key not in self._reported:
                self._reported.add(key)
                log.exception(
                    "health check of %s raised %s; counted as a failed check (logged once "
                    "until it passes again)",
                    up.id,
                    type(exc).__name__,
                )
            return False

    async def check(self, up: Upstream) -> None:
        ok = await self._probe(up)
        h = self.state.config.health
        if ok:
            up.failures = 0
            self._reported = {k for k in self._reported if k[0] != up.id}
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
            ups = self.state.upstreams()
            results = await asyncio.gather(*(self.check(u) for u in ups), return_exceptions=True)
            for up, res in zip(ups, results, strict=True):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                if isinstance(res, BaseException):
                    log.error("health round for %s failed; the loop goes on", up.id, exc_info=res)
