"""Active health checks of the router's instances.

Every ``health.interval_s`` seconds each instance gets ``GET health.path`` (timeout
``health.timeout_s``): a status below 500 is a pass. ``health.failures`` consecutive
failures mark a healthy instance unhealthy; one pass marks an unhealthy one healthy
again. Draining instances are probed but never change state here. The settings are
read each round, so ``PUT /admin/config`` changes them live.

KV capacity: each instance's KV-cache size is learned from what its engine publishes
(``vllm:cache_config_info`` on ``/metrics``, else llama.cpp's ``/props``; see
router/kvcapacity.py) once before the first round, after an instance passes a check
for the first time, and every ``CAPACITY_EVERY`` rounds; it is handed to the variant's
policy (``set_capacity``) every round, so a policy rebuilt by a config change has it at
once, and exported as ``preheat_router_kv_capacity_tokens``. An instance that publishes
neither stays unknown (the policy then bounds its model by entries only).

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

from preheat.router.kvcapacity import capacity_from_metrics, capacity_from_props
from preheat.router.state import RoutingState, Upstream

log = logging.getLogger("preheat.router")

#: Health rounds between two reads of an instance's KV capacity.
CAPACITY_EVERY = 15


class HealthChecker:
    """Probes every instance of ``state`` through ``session``."""

    def __init__(self, state: RoutingState, session: aiohttp.ClientSession) -> None:
        self.state = state
        self.session = session
        self._reported: set[tuple[str, str]] = set()
        self.capacity: dict[str, int | None] = {}
        self._round = 0

    async def _read_capacity(self, up: Upstream) -> int | None:
        """The instance's KV capacity in tokens from its /metrics or /props; None if it
        publishes neither (or is unreachable)."""
        timeout = aiohttp.ClientTimeout(total=self.state.config.health.timeout_s)
        try:
            async with self.session.get(up.id + "/metrics", timeout=timeout) as resp:
                if resp.status == 200:
                    cap = capacity_from_metrics((await resp.read()).decode("utf-8", "replace"))
                    if cap is not None:
                        return cap
            async with self.session.get(up.id + "/props", timeout=timeout) as resp:
                if resp.status == 200:
                    return capacity_from_props(await resp.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return None

    async def learn_capacity(self, up: Upstream) -> None:
        cap = await self._read_capacity(up)
        if cap is not None or up.id not in self.capacity:
            self.capacity[up.id] = cap
        self._push(up)

    def _push(self, up: Upstream) -> None:
        cap = self.capacity.get(up.id)
        rt = self.state.variants.get(up.variant)
        if rt is not None and rt.upstreams.get(up.id) is up:
            rt.policy.set_capacity(up.id, cap)
        if cap is not None:
            self.state.metrics.child(self.state.metrics.kv_capacity, up.variant, up.id).set(cap)

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
        if ok and (up.id not in self.capacity or self._round % CAPACITY_EVERY == 0):
            await self.learn_capacity(up)
        else:
            self._push(up)
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
        ups = self.state.upstreams()
        await asyncio.gather(*(self.learn_capacity(u) for u in ups), return_exceptions=True)
        while True:
            await asyncio.sleep(self.state.config.health.interval_s)
            self._round += 1
            ups = self.state.upstreams()
            results = await asyncio.gather(*(self.check(u) for u in ups), return_exceptions=True)
            for up, res in zip(ups, results, strict=True):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                if isinstance(res, BaseException):
                    log.error("health round for %s failed; the loop goes on", up.id, exc_info=res)
