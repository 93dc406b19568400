"""A Llama-3-style chat template: messages (and tools) to one prompt string.

Same rendering as Llama 3.1's ``tokenizer_config.json`` template for plain messages::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{content}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n

Tools are rendered as JSON into the system turn (as Llama 3.1 does), so requests that
differ only in their tools produce different prompts, exactly like a real engine.
Content may be a string or a list of ``{"type": "text", "text": ...}`` parts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from preheat.errors import ConfigError

__all__ = ["render_chat"]

ROLES = ("system", "user", "assistant", "tool", "developer")


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("text", ""), str):
                raise ConfigError(
                    f'{where}.content[{j}] must be an object like {{"type": "text", "text": "..."}}'
                )
            if part.get("type", "text") == "text":
                parts.append(part.get("text", ""))
        return "".join(parts)
    raise ConfigError(f"{where}.content must be a string or a list of text parts")


def render_chat(
    messages: Sequence[Any],
    tools: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render OpenAI-style chat messages into the Llama-3 prompt text.

    Raises ``ConfigError`` naming the offending field (``messages[2].role`` ...).
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ConfigError("messages must be a non-empty list of {role, content} objects")
    out = ["<|begin_of_text|>"]
    rendered_tools = False
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ConfigError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ConfigError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
        text = _content_text(m.get("content"), where)
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"], sort_keys=True, separators=(",", ":"))
        if role == "system" and tools and not rendered_tools:
            text = _tools_block(tools) + text
            rendered_tools = True
        out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>")
    if tools and not rendered_tools:
        out.insert(
            1, f"<|start_header_id|>system<|end_header_id|>\n\n{_tools_block(tools)}<|eot_id|>"
        )
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def _tools_block(tools: Sequence[Any]) -> str:
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ConfigError("tools must be a list of tool objects")
    body = "\n\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return "Environment: ipython\nYou have access to the following functions:\n\n" + body + "\n\n"
