"""The simulated engine's OpenAI wire format: request validation and answer bodies.

Every bad request gets an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}}``: malformed JSON 400, a missing or wrong-typed field 400 naming it, a body over
``max_body_bytes`` 413, an unknown model 404, 503 while the weights load. Answers carry
OpenAI's ``usage`` object; streams are SSE ``data:`` chunks.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .core.scheduler import SeqOutput
from .core.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "BadRequest",
    "error_response",
    "prompt_tokens",
    "read_body",
    "request_params",
    "sse_chunk",
    "usage_body",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 128


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    code: str | int = {404: "model_not_found"}.get(status, status)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


async def read_body(
    request: web.Request, *, max_body_bytes: int, model: str, ready: bool
) -> dict[str, Any]:
    """The request's JSON object, checked for size, shape, model and readiness."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BadRequest(
            413,
            f"request body exceeds the limit of {max_body_bytes} bytes; send a shorter prompt",
        ) from exc
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise BadRequest(400, "'model' must be a string", "model")
    if asked is not None and asked != model:
        raise BadRequest(
            404,
            f"The model `{asked}` does not exist. This engine serves `{model}`.",
            "model",
        )
    if not ready:
        raise BadRequest(503, "the engine is still loading its weights; retry when /health is 200")
    return body


def request_params(body: dict[str, Any], default_max: int) -> tuple[int, bool, bool, str | None]:
    """``(max_tokens, stream, include_usage, cache_salt)`` of a request body."""
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = default_max
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(
            400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest(400, "'stream_options' must be an object", "stream_options")
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest(400, f"'n' must be 1 (got {n!r}); send separate requests", "n")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
            raise BadRequest(400, f"'{name}' must be a number", name)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest(400, "'cache_salt' must be a string", "cache_salt")
    return max_tokens, stream, bool(opts.get("include_usage", False)), salt


def prompt_tokens(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """A completion's ``prompt`` (one string or a list of token ids) as token ids."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return tokenizer.encode(prompt[0])
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return list(prompt)
    if prompt is None:
        raise BadRequest(400, "'prompt' is required", "prompt")
    raise BadRequest(
        400, "'prompt' must be a string or a non-empty list of token ids (one prompt)", "prompt"
    )


def usage_body(out: SeqOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def sse_chunk(
    head: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
) -> bytes:
    tail = f'"choices":{json.dumps(choices)}'
    if usage is not None:
        tail += f',"usage":{json.dumps(usage)}'
    return f"data: {head}{tail}}}\n\n".encode()
