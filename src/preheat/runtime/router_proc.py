"""The router as a child process, driven through its admin API.

``preheat router serve --port P --config FILE`` starts with every variant of the
endpoint and no instances. The admin token travels in the child's environment
(``PREHEAT_ADMIN_TOKEN``), never on its command line: ``/proc/PID/cmdline`` is readable
by every local user, ``/proc/PID/environ`` only by the owner. The fleet adds an
instance once its replica is healthy and answered a first request, drains it before
stopping it, and patches the strategy when the spec changes. Every call carries the bearer token. With
``decision_log`` the router also appends a sampled ``RouteDecision`` per request
(``--decision-log``/``--decision-sample``): predicted vs engine-reported cached tokens.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import aiohttp

from preheat.control.spec import EndpointSpec
from preheat.errors import ControlError
from preheat.runtime.procs import Child, free_port, preheat_command, spawn, wait_http_ok

__all__ = ["RouterProcess", "router_config"]


def router_config(spec: EndpointSpec) -> dict[str, Any]:
    """The router config for an endpoint: one router variant per endpoint variant."""
    r = spec.routing
    return {
        "variants": [
            {
                "name": v.name,
                "weight": v.weight,
                "strategy": r.strategy,
                "prefix_length": r.prefix_length,
                "concurrency_threshold": r.concurrency_threshold,
                "instances": [],
            }
            for v in spec.variants
        ],
        # The fleet takes a replica out of the router itself when its process exits or it
        # is drained; the router's own checks are the backstop for a hung replica, and
        # must not evict a healthy one that answers slowly on a busy machine.
        "health": {"interval_s": 1.0, "timeout_s": 2.0, "failures": 2},
        "upstream_timeout_s": 120,
    }


class RouterProcess:
    """A running ``preheat router serve`` and a client for its admin API."""

    def __init__(
        self,
        state_dir: Path,
        spec: EndpointSpec,
        port: int | None = None,
        *,
        decision_log: Path | None = None,
        decision_sample: float = 1.0,
    ) -> None:
        self.state_dir = state_dir
        self.port = port or free_port()
        #: Where the router appends sampled ``RouteDecision`` JSONL (``None``: no log).
        self.decision_log = decision_log
        self.decision_sample = decision_sample
        self.token = secrets.token_urlsafe(24)
        self.spec = spec
        self.child: Child | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def start(self, timeout: float = 30.0) -> None:
        conf = self.state_dir / "router.json"
        conf.write_text(json.dumps(router_config(self.spec), indent=1))
        argv = preheat_command(
            "router",
            "serve",
            "--port",
            str(self.port),
            "--config",
            str(conf),
        )
        if self.decision_log is not None:
            argv += [
                "--decision-log",
                str(self.decision_log),
                "--decision-sample",
                repr(self.decision_sample),
            ]
        self.child = await spawn(
            argv, self.state_dir / "logs" / "router.log", env={"PREHEAT_ADMIN_TOKEN": self.token}
        )
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        if not await wait_http_ok(
            self._session, f"{self.url}/health", timeout=timeout, child=self.child
        ):
            # /health may be 503 with no instance yet: accept any answer from the admin API.
            try:
                await self.get_config()
            except ControlError as exc:
                tail = self.child.tail()
                await self.stop()
                raise ControlError(f"the router did not start: {exc}\n{tail}") from None

    async def stop(self) -> None:
        if self.child is not None:
            await self.child.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            raise ControlError("the router is not running")
        try:
            async with self._session.request(
                method, self.url + path, json=body, headers=self._headers()
            ) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise ControlError(f"router {method} {path} -> {resp.status}: {text[:300]}")
                return json.loads(text) if text else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ControlError(f"router {method} {path} failed: {exc}") from exc

    async def get_config(self) -> Any:
        return await self._call("GET", "/admin/config")

    async def add(self, variant: str, url: str) -> None:
        await self._call("POST", "/admin/instances/add", {"variant": variant, "url": url})

    async def drain(self, variant: str, url: str) -> None:
        await self._call("POST", "/admin/instances/drain", {"variant": variant, "url": url})

    async def remove(self, variant: str, url: str) -> None:
        await self._call("POST", "/admin/instances/remove", {"variant": variant, "url": url})

    async def patch(self, variant: str, fields: dict[str, Any]) -> None:
        await self._call("PATCH", f"/admin/variants/{variant}", fields)

    async def apply_spec(self, spec: EndpointSpec) -> None:
        """Bring variants, weights and strategy in line with ``spec``, keeping instances."""
        current = await self.get_config()
        instances = {v["name"]: v.get("instances", []) for v in current.get("variants", [])}
        new = router_config(spec)
        for v in new["variants"]:
            v["instances"] = instances.get(v["name"], [])
        await self._call("PUT", "/admin/config", new)
        self.spec = spec
