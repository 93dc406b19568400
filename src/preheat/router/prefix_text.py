"""Canonical prompt text of an OpenAI request body (pure): what router/prefix.py hashes.

The fields that change the rendered prompt (tools, chat template, documents) come first,
then the role-tagged messages (or the completion prompt). ``canonical_parts`` hands back
the body's own strings in order, so a long message is neither copied into a joined text
nor encoded past the prefix length (router/prefix.py ``PrefixHasher.chain_parts``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from preheat.errors import ConfigError

__all__ = ["canonical", "canonical_parts", "canonical_text"]

# Request fields that change the prompt an engine renders (besides messages/prompt).
_PROMPT_FIELDS = ("tools", "functions", "documents", "chat_template", "chat_template_kwargs")
_SEP = "\x1e"  # record separator: cannot be confused with ordinary text boundaries


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                kind = part.get("type")
                if kind == "text":
                    parts.append(str(part.get("text", "")))
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url", "") if isinstance(url, Mapping) else url
                    parts.append(f"{_SEP}image:{url}")
                else:
                    parts.append(_SEP + json.dumps(part, sort_keys=True, separators=(",", ":")))
            else:
                parts.append(str(part))
        return "".join(parts)
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def canonical_text(body: Mapping[str, Any]) -> str:
    """The canonical prompt text of an OpenAI request body (see ``canonical``)."""
    return canonical(body)[0]


def canonical(body: Mapping[str, Any]) -> tuple[str, list[int]]:
    """The canonical prompt text of an OpenAI completions or chat-completions body.

    Chat: prompt-changing fields (tools, chat template, ...) first, then every message as
    ``<sep>role[:name]<sep>content`` (tool calls included), then whether a generation
    prompt is added. Completions: the ``prompt`` string (the first of a batch; token ids
    are written as decimal numbers). Returns the text and the offsets where each message
    ends. Raises ``ConfigError`` for a body with neither.
    """
    parts, ends, _ = canonical_parts(body)
    return "".join(parts), ends


def canonical_parts(body: Mapping[str, Any]) -> tuple[list[str], list[int], int]:
    """``canonical`` without joining: the pieces of the text in order, the message ends
    and the total length. The pieces are the body's own strings (a 32,000-character
    message is not copied), which ``PrefixHasher.chain_parts`` hashes as if joined."""
    out: list[str] = []
    ends: list[int] = []
    size = 0
    for field in _PROMPT_FIELDS:
        value = body.get(field)
        if value is not None:
            dumped = json.dumps(value, sort_keys=True, separators=(",", ":"))
            out.append(f"{_SEP}{field}{_SEP}{dumped}")
            size += len(out[-1])
    if out:
        ends.append(size)
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise ConfigError("'messages' must be a list of {role, content} objects")
        for m in messages:
            if not isinstance(m, Mapping):
                raise ConfigError("each entry of 'messages' must be an object with a 'role'")
            role = str(m.get("role", ""))
            name = m.get("name")
            head = f"{_SEP}{role}:{name}{_SEP}" if name else f"{_SEP}{role}{_SEP}"
            content = m.get("content")
            text = content if isinstance(content, str) else _content_text(content)
            out.append(head)
            out.append(text)
            size += len(head) + len(text)
            calls = m.get("tool_calls")
            if calls:
                out.append(_SEP + json.dumps(calls, sort_keys=True, separators=(",", ":")))
                size += len(out[-1])
            ends.append(size)
        if body.get("add_generation_prompt", True) is False:
            out.append(f"{_SEP}no_generation_prompt")
            size += len(out[-1])
        return out, ends, size
    prompt = body.get("prompt")
    if prompt is None:
        raise ConfigError("the request has neither 'messages' nor 'prompt'; nothing to route on")
    if isinstance(prompt, list):
        first = prompt[0] if prompt else ""
        if isinstance(first, int):  # a single prompt given as token ids
            prompt = ",".join(str(t) for t in prompt)
        elif isinstance(first, list):  # a batch of token-id prompts
            prompt = ",".join(str(t) for t in first)
        else:
            prompt = str(first)
    elif not isinstance(prompt, str):
        prompt = str(prompt)
    out.append(prompt)
    return out, ends, len(prompt)
