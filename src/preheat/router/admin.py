"""The router's admin API: change instances and strategies at run time, without restart.

Every call needs ``Authorization: Bearer <token>`` (401 without or with a wrong token;
403 when the router was started without a token). Bodies and answers are JSON.

* ``GET /admin/config``: the whole config, each instance as {url, state, in_flight},
  state one of healthy | unhealthy | draining.
* ``PUT /admin/config``: replace the whole config (same format; instances may be URLs
  or objects), live: timeouts and health settings apply to the next request or round.
  Invalid, or a change to a restart-only field (``max_body_bytes``) -> 400 with the
  reason, and the old config stays.
* ``POST /admin/instances/add`` {"variant", "url"}: the instance takes traffic at once.
* ``POST /admin/instances/remove`` {"variant", "url"}: no new requests; in-flight ones
  finish.
* ``POST /admin/instances/drain`` {"variant", "url"}: kept but sent nothing new; its
  in-flight requests finish (watch ``in_flight`` reach 0, then remove it).
* ``PATCH /admin/variants/{name}`` {"strategy"?, "prefix_length"?,
  "concurrency_threshold"?, "weight"?, "balance_epsilon"?}.

Successful calls answer 200 with the new ``GET /admin/config`` document.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from preheat.errors import ConfigError
from preheat.router.config import check_url, parse_config, patch_variant

if TYPE_CHECKING:
    from preheat.router.server import Router

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def _json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"the body is not valid JSON: {exc}") from None


def _target(data: Any) -> tuple[str, str]:
    if not isinstance(data, dict) or not isinstance(data.get("variant"), str):
        raise ConfigError('give {"variant": NAME, "url": "http://host:port"}')
    return data["variant"], check_url(data.get("url"), where=f"variant {data['variant']!r}")


def add_admin_routes(app: web.Application, router: Router) -> None:
    """Mount the admin API on ``app`` for ``router``."""

    def guarded(fn: Callable[[web.Request], Awaitable[web.Response]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            token = router.admin_token
            if not token:
                return _error(403, "the admin API is off: start the router with --admin-token")
            got = request.headers.get("Authorization", "")
            if not got.startswith("Bearer ") or not hmac.compare_digest(
                got[7:].encode(), token.encode()
            ):
                return _error(401, "missing or wrong admin token (Authorization: Bearer <token>)")
            try:
                return await fn(request)
            except ConfigError as exc:
                return _error(400, str(exc))

        return handler

    def ok() -> web.Response:
        return web.json_response(router.snapshot())

    async def get_config(request: web.Request) -> web.Response:
        return ok()

    async def put_config(request: web.Request) -> web.Response:
        router.replace_config(parse_config(await _json(request)))
        return ok()

    async def add(request: web.Request) -> web.Response:
        variant, url = _target(await _json(request))
        cfg = router.config
        vc = cfg.variant(variant)
        existing = router.find(url)
        if existing is not None:
            if existing.variant != variant:
                return _error(409, f"{url} already belongs to variant {existing.variant!r}")
            if existing.state == "draining":
                router.set_state(existing, "healthy")
            return ok()
        router.replace_config(
            parse_config(cfg.with_variant(replace(vc, instances=(*vc.instances, url))).to_dict())
        )
        return ok()

    async def remove(request: web.Request) -> web.Response:
        variant, url = _target(await _json(request))
        cfg = router.config
        vc = cfg.variant(variant)
        if url not in vc.instances:
            return _error(404, f"{url} is not an instance of variant {variant!r}")
        rest = tuple(u for u in vc.instances if u != url)
        router.replace_config(cfg.with_variant(replace(vc, instances=rest)))
        return ok()

    async def drain(request: web.Request) -> web.Response:
        variant, url = _target(await _json(request))
        vc = router.config.variant(variant)
        up = router.find(url)
        if up is None or url not in vc.instances:
            return _error(404, f"{url} is not an instance of variant {variant!r}")
        router.set_state(up, "draining")
        return ok()

    async def patch(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        cfg = router.config
        try:
            vc = cfg.variant(name)
        except ConfigError as exc:
            return _error(404, str(exc))
        router.replace_config(cfg.with_variant(patch_variant(vc, await _json(request))))
        return ok()

    app.router.add_get("/admin/config", guarded(get_config))
    app.router.add_put("/admin/config", guarded(put_config))
    app.router.add_post("/admin/instances/add", guarded(add))
    app.router.add_post("/admin/instances/remove", guarded(remove))
    app.router.add_post("/admin/instances/drain", guarded(drain))
    app.router.add_patch("/admin/variants/{name}", guarded(patch))
