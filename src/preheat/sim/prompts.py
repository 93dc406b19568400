"""Request bodies to the tokens and KV block hashes the simulated engine computes (pure).

The same steps as the engine (``engine/openai_api.py``): a chat body is rendered with the engine's chat
template (``engine.core.chat.render_chat``) and encoded by its tokenizer; a completions
``prompt`` is encoded, or taken as token ids; ``max_tokens`` (or
``max_completion_tokens``) defaults to the engine's 128 (chat) or 16 (completions).
So a body replayed here and sent to a live engine yields the same prompt tokens.

Memoisation (exact, for speed): the tokenizer treats special tokens as separators, so
the text cut after each ``<|eot_id|>`` encodes piece by piece to the same ids. Each
piece, keyed by the pieces before it, keeps its cumulative tokens and full-block
hashes in a bounded LRU; a request that repeats a conversation's or a document's
earlier messages reuses them and hashes only its new blocks (``block_hashes`` with
``parent``), which gives the same chain as hashing the whole prompt. The piece after
the last message (the generation prompt) is never a later prompt's prefix and is not
kept, nor is the last message's own piece: it is usually unique (a question after a
shared document), and keeping it filled the memo with copies of the prefix (a long
cumulative tuple per request) that were never hit, which cost memory, evictions of the
shared prefixes and garbage-collector time; a chat's next turn encodes that message
again (one short ``encode``). Completions prompts have no safe cut and are encoded whole.

A new piece is cut the same way at every special token (the role headers) and each
text part between them is encoded by the tokenizer; short parts (a role name, the
generation prompt's parts) are kept in a small table, so a piece costs one ``encode``
of its content.

Plain messages (a list of dicts with a known role and string content without ``<|``,
no tools, no tool calls: every workload's chat bodies) skip the rendering: message
``k``'s piece is then exactly ``[<|begin_of_text|>]<|start_header_id|>ROLE
<|end_header_id|>\n\nCONTENT<|eot_id|>``, whose tokens are the special ids around
``encode(ROLE)`` and ``encode("\n\n" + CONTENT)``, so the memo is keyed by the role
and the content string itself (hashed once per string object) instead of the rendered
piece, and the generation prompt's tokens are a constant. Anything else is rendered
with ``render_chat`` as before (which also names what is wrong with a bad body).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from preheat.engine.core.chat import ROLES, render_chat
from preheat.engine.core.tokenizer import SPECIAL_TOKENS, Tokenizer
from preheat.engine.core.tokens import JoinedTokens
from preheat.errors import ConfigError
from preheat.kvcache import DEFAULT_BLOCK_SIZE, block_hashes

__all__ = ["DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_COMPLETION_MAX_TOKENS", "Prompt", "PromptBuilder"]

# The engine's defaults (engine/openai_api.py; a unit test keeps them equal).
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 128
_EOT = "<|eot_id|>"
# A memoised piece: its node id, the cumulative tokens and full-block hashes through it.
_Node = tuple[int, tuple[int, ...], tuple[int, ...]]
_SPECIAL = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")
_SHORT = 64  # text parts up to this many characters are kept in the parts table
_PARTS_MAX = 4096  # entries in the parts table before it is emptied
_BOT = SPECIAL_TOKENS["<|begin_of_text|>"]
_SH = SPECIAL_TOKENS["<|start_header_id|>"]
_EH = SPECIAL_TOKENS["<|end_header_id|>"]
_EOT_ID = SPECIAL_TOKENS[_EOT]


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the engine computes for one body: prompt tokens, their full-block hashes."""

    tokens: Sequence[int]
    """A tuple, or a memoised prefix and the rest as ``JoinedTokens`` (never copied)."""
    hashes: tuple[int, ...]
    max_tokens: int
    salt: str | None


class PromptBuilder:
    """Tokenizes and hashes bodies like the simulated engine, memoising shared pieces.

    ``memo_tokens`` bounds the memo by the tokens it holds (cumulative per piece).
    """

    def __init__(
        self, block_size: int = DEFAULT_BLOCK_SIZE, *, memo_tokens: int = 16_000_000
    ) -> None:
        self.block_size = block_size
        self.tokenizer = Tokenizer()
        self.memo_tokens = memo_tokens
        # Keys: (node, salt, piece) for rendered pieces, (node, salt, role, content) for
        # plain messages.
        self._memo: OrderedDict[tuple[Any, ...], _Node] = OrderedDict()
        self._held = 0
        self._next_id = 1
        self._parts: dict[str, tuple[int, ...]] = {}
        enc = self.tokenizer.encode
        # A plain message's tokens before and after "\n\n" + content, by role and by
        # whether it is the first (after <|begin_of_text|>); the generation prompt's.
        self._heads = {
            (role, first): ((_BOT,) if first else ()) + (_SH, *enc(role), _EH)
            for role in ROLES
            for first in (True, False)
        }
        self._gen = (_SH, *enc("assistant"), _EH, *enc("\n\n"))
        # The same with the "\n\n" that opens the content: ``encode("\n\n" + c)`` is
        # ``encode("\n\n") + encode(c)`` unless ``c`` starts with whitespace (which the
        # "\n\n" token would absorb), so the content is encoded as it is, not copied.
        nl2 = tuple(enc("\n\n"))
        self._opens = {k: head + nl2 for k, head in self._heads.items()}

    def build(self, path: str | None, body: Mapping[str, Any]) -> Prompt:
        """The engine's view of ``body`` sent to ``path`` (``None``: chat if the body has
        ``messages``, else completions); ``ConfigError`` names a bad field."""
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ConfigError("'cache_salt' must be a string")
        chat = "messages" in body if path is None else path.endswith("/chat/completions")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
        if chat:
            if "messages" not in body:
                raise ConfigError("'messages' is required for /v1/chat/completions")
            messages = body["messages"]
            got = None
            if not body.get("tools") and _plain(messages):
                got = self._plain_chat(messages, salt)
            if got is None:
                got = self._chat(render_chat(messages, body.get("tools")), salt)
            tokens, hashes = got
        else:
            tokens = tuple(self._prompt_ids(body.get("prompt")))
            hashes = tuple(block_hashes(tokens, self.block_size, salt=salt))
        return Prompt(tokens, hashes, max_tokens, salt)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        # As EngineServer._prompt_tokens: a string, [string], or token ids.
        enc = self.tokenizer.encode
        if isinstance(prompt, str):
            return enc(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return enc(prompt[0])
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            return list(prompt)
        raise ConfigError("'prompt' must be a string or a non-empty list of token ids")

    def _chat(self, text: str, salt: str | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        pieces = text.split(_EOT)
        memo = self._memo
        bs = self.block_size
        node = 0
        tokens: tuple[int, ...] = ()
        hashes: tuple[int, ...] = ()
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            if i < last:
                piece += _EOT
            elif not piece:
                break
            key = (node, salt, piece)
            hit = memo.get(key)
            if hit is not None:
                memo.move_to_end(key)
                node, tokens, hashes = hit
                continue
            tokens = tokens + self._encode(piece)
            start = len(hashes) * bs
            full = len(tokens) // bs * bs
            if full > start:
                parent = hashes[-1] if hashes else None
                more = block_hashes(tokens[start:full], bs, parent=parent, salt=salt)
                hashes = hashes + tuple(more)
            if i >= last - 1:
                continue  # the last message's piece and the generation prompt: not kept
            node = self._next_id
            self._next_id += 1
            memo[key] = (node, tokens, hashes)
            self._held += len(tokens)
            while self._held > self.memo_tokens and len(memo) > 1:
                _, (_, old, _) = memo.popitem(last=False)
                self._held -= len(old)
        return tokens, hashes

    def _plain_chat(
        self, messages: list[dict[str, Any]], salt: str | None
    ) -> tuple[Sequence[int], tuple[int, ...]] | None:
        # _chat of render_chat(messages) for plain messages (see the module docstring):
        # the same pieces, tokens and hashes, keyed (node, salt, role, content); None
        # when a content not seen before has "<|" (a hit's content was checked when it
        # was kept).
        memo = self._memo
        bs = self.block_size
        enc = self.tokenizer.encode
        heads = self._heads
        opens = self._opens
        node = 0
        tokens: tuple[int, ...] = ()
        hashes: tuple[int, ...] = ()
        n = len(messages)
        for k in range(n):
            m = messages[k]
            role = m["role"]
            content = m["content"]
            key = (node, salt, role, content)
            hit = memo.get(key)
            if hit is not None:
                memo.move_to_end(key)
                node, tokens, hashes = hit
                continue
            if "<|" in content:
                return None
            if content[:1].isspace():
                head, ids = heads[role, k == 0], enc("\n\n" + content)
            else:
                head, ids = opens[role, k == 0], enc(content)
            if k == n - 1:  # the last message and the generation prompt: one list
                last = [*head, *ids, _EOT_ID, *self._gen]
                break
            # (tuple + tuple: PyPy keeps a tuple's ints boxed, so copying the long
            # prefix as a tuple is cheaper than unpacking it)
            own = (*head, *ids, _EOT_ID)
            tokens = tokens + own
            start = len(hashes) * bs
            full = len(tokens) // bs * bs
            if full > start:
                parent = hashes[-1] if hashes else None
                more = block_hashes(tokens[start:full], bs, parent=parent, salt=salt)
                hashes = hashes + tuple(more)
            node = self._next_id
            self._next_id += 1
            memo[key] = (node, tokens, hashes)
            self._held += len(tokens)
            while self._held > self.memo_tokens and len(memo) > 1:
                _, (_, old, _) = memo.popitem(last=False)
                self._held -= len(old)
        else:  # the last message was memoised (an earlier turn of a later chat)
            last = list(self._gen)
        # The last message's piece and the generation prompt are not kept, nor copied
        # onto the memoised prefix: ``JoinedTokens`` holds both, the last part as a list,
        # whose ints PyPy stores unboxed (a tuple would box each new id: objects its
        # garbage collector copies and traces while the request is in flight, as the
        # engine keeps the prompt for the request's life). Only the blocks from the
        # prefix's last partial one on are hashed.
        start = len(hashes) * bs
        lt = len(tokens)
        full = (lt + len(last)) // bs * bs
        if full > start:
            parent = hashes[-1] if hashes else None
            span: Sequence[int]
            if start < lt:
                span = (*tokens[start:], *last[: full - lt])
            else:
                span = last[start - lt : full - lt]
            hashes = hashes + tuple(block_hashes(span, bs, parent=parent, salt=salt))
        return JoinedTokens(tokens, last), hashes

    def _encode(self, piece: str) -> tuple[int, ...]:
        # Tokenizer.encode(piece): special tokens are separators, so it is the parts'
        # encodings in order (tests/unit/test_sim_prompts.py checks it on every workload).
        if "<|" not in piece:
            return tuple(self.tokenizer.encode(piece))
        special = SPECIAL_TOKENS
        parts = self._parts
        enc = self.tokenizer.encode
        out: list[int] = []
        for i, part in enumerate(_SPECIAL.split(piece)):
            if i % 2:
                out.append(special[part])
            elif len(part) > _SHORT:
                out += enc(part)
            elif part:
                ids = parts.get(part)
                if ids is None:
                    if len(parts) >= _PARTS_MAX:
                        parts.clear()
                    ids = parts[part] = tuple(enc(part))
                out += ids
        return tuple(out)


def _plain(messages: Any) -> bool:
    """True for a non-empty list of ``{"role": ROLE, "content": str}`` dicts (other keys
    allowed but no ``tool_calls``): if no content has ``<|`` (``_plain_chat`` checks),
    their rendered pieces are known without rendering."""
    if type(messages) is not list or not messages:
        return False
    for m in messages:
        if type(m) is not dict or m.get("tool_calls"):
            return False
        content = m.get("content")
        if type(content) is not str or m.get("role") not in ROLES:
            return False
    return True
