"""The proxy under aiohttp: the request adapter, the answer ``Sink``, and the https client.

``Proxy.proxy`` (``proxy.py``) is the aiohttp handler of the two proxy routes. It runs
when the router serves with ``--front aiohttp``, when the raw-protocol front hands a
request it does not serve itself to the aiohttp application, and in tests that mount
``server.build_app``. Instances behind ``https://`` are reached through aiohttp's client
(``https_post``) whichever server took the request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from preheat.router.state import VARIANT_HEADER
from preheat.router.upstream_errors import BadResponse, ConnectFailed, Disconnected
from preheat.router.wire import HINT_HEADER, HOP, Incoming, passed_headers

log = logging.getLogger("preheat.router")


def incoming_of(request: web.Request, raw: bytes) -> Incoming:
    """An aiohttp request (body already read) as the proxy's ``Incoming``."""
    h = request.headers
    block = "".join(f"\r\n{k}: {v}" for k, v in h.items() if k.lower() not in HOP)
    return Incoming(
        path=request.path,
        raw=raw,
        variant=h.get(VARIANT_HEADER),
        request_id=h.get("X-Request-Id") or None,
        hint=h.get(HINT_HEADER),
        headers=block.encode("utf-8", "surrogateescape"),
    )


class WebSink:
    """Answers an aiohttp request; the handler returns ``response`` afterwards."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self._response: web.StreamResponse | None = None

    @property
    def response(self) -> web.StreamResponse:
        if self._response is None:
            raise RuntimeError("the proxy handler did not answer")
        return self._response

    def reply(self, status: int, headers: dict[str, str], body: bytes, passed: str = "") -> None:
        hdrs = multidict_of(passed, headers)
        self._response = web.Response(body=body, status=status, headers=hdrs)

    async def start(self, status: int, headers: dict[str, str], passed: str = "") -> None:
        out = web.StreamResponse(status=status, headers=multidict_of(passed, headers))
        await out.prepare(self.request)
        self._response = out

    async def write(self, chunk: bytes) -> None:
        await self.response.write(chunk)

    async def end(self) -> None:
        await self.response.write_eof()


def multidict_of(passed: str, headers: Mapping[str, str]) -> CIMultiDict[str]:
    """An instance's passed header lines (repeats kept) and then the router's ``headers``
    (each replacing any the instance sent) as aiohttp response headers."""
    out: CIMultiDict[str] = CIMultiDict()
    for line in passed.split("\r\n"):
        k, sep, v = line.partition(": ")
        if sep:
            out.add(k, v)
    for k, v in headers.items():
        out[k] = v
    return out


def _headers_of(block: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in block.decode("utf-8", "surrogateescape").split("\r\n"):
        k, sep, v = line.partition(": ")
        if sep:
            out[k] = v
    return out


async def https_post(
    session: aiohttp.ClientSession,
    url: str,
    raw: bytes,
    headers: bytes,
    timeout: aiohttp.ClientTimeout,
) -> AiohttpResponse:
    """POST through aiohttp, retried once on a fresh connection if a pooled one was stale
    (an instance may close an idle connection just as it is reused: not the instance
    failing); a refused connection is not retried. Errors as ``upstream.py``'s."""
    hdrs = _headers_of(headers)
    try:
        try:
            return AiohttpResponse(await session.post(url, data=raw, headers=hdrs, timeout=timeout))
        except TimeoutError:
            raise
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            log.debug("retrying %s on a fresh connection after %r", url, exc)
            return AiohttpResponse(await session.post(url, data=raw, headers=hdrs, timeout=timeout))
    except TimeoutError:
        raise
    except aiohttp.ClientConnectorError as exc:
        raise ConnectFailed(str(exc)) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise Disconnected(str(exc), reused=False, started=False) from exc
    except aiohttp.ClientError as exc:
        raise BadResponse(str(exc)) from exc


class AiohttpResponse:
    """An aiohttp response behind ``UpstreamResponse``'s interface (https instances)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.headers.items()}
        self.passed = passed_headers(resp.headers.items())

    async def __aenter__(self) -> AiohttpResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.resp.release()

    async def read(self) -> bytes:
        try:
            return await self.resp.read()
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise Disconnected(str(exc), reused=False, started=True) from exc

    async def iter_any(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.content.iter_any():
                yield chunk
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise Disconnected(str(exc), reused=False, started=True) from exc
