"""The small local API through which `preheat status|scale|apply|down|node` reach a
running `preheat up`.

The server listens on 127.0.0.1 on a free port and writes ``<state>/control.json``
(``{"url", "token", "pid"}``, mode 0600); every call carries ``Authorization: Bearer``
with that token, so only users who can read the state directory can steer the fleet.

    GET  /status                          the fleet's status document, with each node's
                                          cache inventory under "inventory"
    GET  /metrics                         Prometheus text (no token needed)
    POST /scale   {"replicas", "variant"?}
    POST /apply   {"spec": {...}}          an endpoint document (validated like a file)
    POST /nodes/{name}/fail
    POST /nodes/{name}/add {"capacity"?, "labels"?, "slots"?}
    POST /revoke {"key", "reason"?}        put KEY on the fleet's revocation list
    POST /unrevoke {"key"}                 take it off again
    POST /down                             stop everything and exit `up`

Errors answer ``{"error": message}`` with 400 (bad input; nothing changed), 409 (a
state conflict such as failing a node that is down) or 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import secrets
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from preheat.artifacts.refs import redact_url
from preheat.config import parse_size
from preheat.control.spec import parse_endpoint
from preheat.errors import ConfigError, ControlError
from preheat.runtime.local import LocalFleet
from preheat.telemetry.prometheus import CONTENT_TYPE_LATEST

__all__ = ["ControlServer", "call", "control_file"]


def control_file(state_dir: Path) -> Path:
    return Path(state_dir) / "control.json"


class ControlServer:
    """Serves the control API for one fleet; ``down`` is set when asked to stop."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        self.token = secrets.token_urlsafe(24)
        self.down = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/scale", self._scale)
        app.router.add_post("/apply", self._apply)
        app.router.add_post("/nodes/{name}/fail", self._fail)
        app.router.add_post("/nodes/{name}/add", self._add)
        app.router.add_post("/revoke", self._revoke)
        app.router.add_post("/unrevoke", self._unrevoke)
        app.router.add_post("/down", self._down)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{port}"
        path = control_file(self.fleet.state_dir)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"url": self.url, "token": self.token, "pid": os.getpid()}, f)
        os.replace(tmp, path)

    async def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            control_file(self.fleet.state_dir).unlink()
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ")
        # /metrics is read-only and holds no secret: scrapers need no token.
        if request.path != "/metrics" and not hmac.compare_digest(
            given.encode(), self.token.encode()
        ):
            return web.json_response({"error": "unauthorized"}, status=401)
        # Error messages may quote a source URL: never with its credentials.
        try:
            return await handler(request)
        except ConfigError as exc:
            return web.json_response({"error": redact_url(str(exc))}, status=400)
        except ControlError as exc:
            return web.json_response({"error": redact_url(str(exc))}, status=409)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": redact_url(f"bad request: {exc}")}, status=400)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            raise ConfigError("the request body is not JSON") from None
        if not isinstance(data, dict):
            raise ConfigError("the request body must be a JSON object")
        return data

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(await self.fleet.full_status())

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(self.fleet.metrics_text)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _scale(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        replicas = body.get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise ConfigError(f"replicas {replicas!r} is not a whole number")
        await self.fleet.scale(replicas, body.get("variant"))
        return web.json_response(self.fleet.status())

    async def _apply(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        spec = parse_endpoint(body.get("spec"), origin=str(body.get("origin", "endpoint spec")))
        await self.fleet.apply(spec)
        return web.json_response(self.fleet.status())

    async def _fail(self, request: web.Request) -> web.Response:
        await self.fleet.fail_node(request.match_info["name"])
        return web.json_response(self.fleet.status())

    async def _add(self, request: web.Request) -> web.Response:
        body = await self._body(request) if request.can_read_body else {}
        capacity = body.get("capacity")
        labels = body.get("labels")
        if labels is not None and not (
            isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())
        ):
            raise ConfigError('labels must be an object of strings, e.g. {"gpu": "yes"}')
        slots = body.get("slots")
        await self.fleet.add_node(
            request.match_info["name"],
            capacity=parse_size(capacity, what="capacity") if capacity is not None else None,
            labels=labels,
            slots=int(slots) if slots is not None else None,
        )
        return web.json_response(self.fleet.status())

    async def _revoke(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        key = body.get("key")
        if not isinstance(key, str) or not key.strip():
            raise ConfigError('revoke needs {"key": DIGEST-or-REVISION, "reason"?: text}')
        return web.json_response(await self.fleet.revoke(key, str(body.get("reason") or "")))

    async def _unrevoke(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        key = body.get("key")
        if not isinstance(key, str) or not key.strip():
            raise ConfigError('unrevoke needs {"key": DIGEST-or-REVISION}')
        return web.json_response({"key": key, "was_revoked": await self.fleet.unrevoke(key)})

    async def _down(self, request: web.Request) -> web.Response:
        self.down.set()
        return web.json_response({"stopping": True})


def call(state_dir: Path, method: str, path: str, body: Any = None, timeout: float = 120) -> Any:
    """Call a running `preheat up` in ``state_dir`` (blocking; for the CLI)."""
    cf = control_file(state_dir)
    try:
        info = json.loads(cf.read_text())
    except FileNotFoundError:
        raise ControlError(
            f"no running `preheat up` in {state_dir} (no {cf.name}); start one with "
            "`preheat up -f endpoint.yaml`, or pass the same --state-dir"
        ) from None
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        info["url"] + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {info['token']}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        with exc:  # the error holds the response's socket until closed
            try:
                message = json.loads(exc.read()).get("error", str(exc))
            except ValueError:
                message = str(exc)
        if exc.code == 400:
            raise ConfigError(message) from None
        raise ControlError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(
            f"`preheat up` in {state_dir} does not answer at {info['url']} ({exc}); "
            f"if it is gone, remove {cf}"
        ) from None
