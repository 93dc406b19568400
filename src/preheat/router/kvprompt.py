"""A request body to the block hashes an engine will give its prompt, cached (pure).

The router's precise KV index (router/kvprecise.py) needs, for every request, the hashes
of the prompt's full token blocks exactly as the engine computes them: render the chat
template, tokenize, hash each block of ``block_size`` tokens into a chain
(preheat/kvhash.py). Tokenizing a 5,000-character prompt costs about 0.5 ms in Python,
most of it spent again on the same documents, system prompts and histories. So:

* **Chunks.** The rendered prompt is cut into chunks of about ``CHUNK_CHARS`` (512)
  characters, each cut at a space between two ASCII letters (``"a b"``). Pre-tokenizers
  (GPT-2/Llama-3 byte-level regexes, the simulated engine's) never join a letter, a
  space and a letter into one piece that crosses that space, so tokenizing chunk by
  chunk gives the same tokens as tokenizing the whole; a tokenizer for which a
  self-check (``check_chunking``) finds otherwise is tokenized whole.
* **Chained cache.** A chunk's entry is keyed by (the previous chunk's key, the chunk's
  text) and holds the chain state after it: the hash state, the tokens of the partial
  block still open, the block hashes the chunk completed, the token count. A prompt
  whose leading chunks were seen before costs one dict probe per chunk; only new chunks
  are tokenized and hashed. The cache keeps ``MAX_CHUNKS`` (32,768, about 30 MB)
  entries, least recently used first out.

``EngineCodec`` is the simulated engine's template and tokenizer (engine/core); real
models' ``tokenizer.json`` codecs are in router/tokenize.py.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, Protocol

from preheat.engine.core.chat import render_chat
from preheat.engine.core.tokenizer import Tokenizer
from preheat.errors import ConfigError
from preheat.kvhash import HashScheme

__all__ = ["CHUNK_CHARS", "MAX_CHUNKS", "EngineCodec", "PromptBlocks", "PromptCodec"]

CHUNK_CHARS = 256
MAX_CHUNKS = 32768
_SAMPLE = (
    "The quick brown fox jumps over the lazy dog near the riverbank, while 42 curious "
    "otters watch; meanwhile the caching layer keeps every prefix warm and ready. "
) * 6


class PromptCodec(Protocol):
    """What the router needs of an engine's prompt handling."""

    name: str
    chunking: bool

    def prompt(self, body: Mapping[str, Any]) -> tuple[tuple[int, ...], str] | list[int] | None:
        """(tokens the engine puts first, the text to tokenize), token ids, or None."""
        ...

    def encode(self, text: str) -> list[int]:
        """Tokens of a piece of text, no special tokens added."""
        ...


def check_chunking(codec: PromptCodec, sample: str = _SAMPLE) -> bool:
    """True when tokenizing ``sample`` chunk by chunk gives the tokens of the whole."""
    whole = codec.encode(sample)
    parts: list[int] = []
    for chunk in _chunks(sample, 40):
        parts.extend(codec.encode(chunk))
    return parts == whole


class EngineCodec:
    """The simulated engine's chat template (engine/core/chat.py) and tokenizer."""

    name = "engine"
    chunking = True

    def __init__(self) -> None:
        self._tok = Tokenizer()

    def prompt(self, body: Mapping[str, Any]) -> tuple[tuple[int, ...], str] | list[int] | None:
        msgs = body.get("messages")
        if msgs is not None:
            try:
                return (), render_chat(msgs, body.get("tools"))
            except ConfigError:
                return None
        return _completion_prompt(body.get("prompt"), ())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)


def _completion_prompt(
    prompt: Any, lead: tuple[int, ...]
) -> tuple[tuple[int, ...], str] | list[int] | None:
    """A completions ``prompt`` as the engines take it: a string, [string], or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return lead, prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return list(prompt)
    return None


def _chunks(text: str, size: int) -> list[str]:
    """``text`` cut at a space between two ASCII letters every ``size`` characters or so:
    each chunk ends before the first such space at least ``size`` characters after its
    start (the space opens the next chunk); the last takes the rest."""
    n = len(text)
    if n <= size:
        return [text] if n else []
    out = _cutter(size).findall(text)
    rest = n - sum(map(len, out))
    if rest:
        out.append(text[n - rest :])
    return out


@lru_cache(maxsize=16)
def _cutter(size: int) -> re.Pattern[str]:
    # At least ``size`` characters, then lazily up to a letter followed by " " + letter.
    # Consecutive matches tile the text: once a match fails, no later one can succeed
    # (a qualifying space after a later start would qualify for this one too).
    return re.compile(r"(?s).{" + str(size) + r"}.*?(?<=[A-Za-z])(?= [A-Za-z])")


class PromptBlocks:
    """Body -> (external block hashes, prompt tokens), cached by chunk (module header)."""

    def __init__(
        self,
        codec: PromptCodec,
        scheme: HashScheme,
        block_size: int = 16,
        *,
        max_chunks: int = MAX_CHUNKS,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        self.codec = codec
        self.scheme = scheme
        self.block_size = block_size
        self.max_chunks = max_chunks
        self.chunk_chars = chunk_chars if codec.chunking else 1 << 62
        # key -> (hash state, token count, k, the k tokens of the open block, the block
        # hashes the chunk completed...): one flat tuple, so a new chunk leaves one object
        # for the cyclic GC's young generation to visit, not three (``_walk``).
        self._cache: OrderedDict[int, tuple[Any, ...]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def key(self) -> tuple[str, str, str | None, int]:
        """What makes two instances' hashes comparable (same codec, scheme, block size)."""
        return (self.codec.name, self.scheme.name, self.scheme.seed, self.block_size)

    def blocks(self, body: Mapping[str, Any]) -> tuple[list[int], int] | None:
        """The prompt's full-block hashes and token count (None: no prompt to hash)."""
        p = self.codec.prompt(body)
        if p is None:
            return None
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        if isinstance(p, list):
            return self.scheme.hashes(p, self.block_size, salt), len(p)
        lead, text = p
        return self._walk(lead, text, salt)

    def _walk(self, lead: tuple[int, ...], text: str, salt: str | None) -> tuple[list[int], int]:
        bs = self.block_size
        scheme = self.scheme
        cache = self._cache
        state: Any = scheme.root(salt)
        tail: tuple[int, ...] = lead
        ntok = len(lead)
        key = hash((salt, lead))
        out: list[int] = []
        get, to_end, extend = cache.get, cache.move_to_end, out.extend
        hits = 0
        # The entry of the last chunk found cached, read out only when a chunk after it is
        # not (its state and open block are needed then) or at the end (its count).
        last: tuple[Any, ...] | None = None
        for chunk in _chunks(text, self.chunk_chars):
            key = hash((key, chunk))
            hit = get(key)
            if hit is not None:
                to_end(key)
                last = hit
                extend(hit[3 + hit[2] :])
                hits += 1
                continue
            if last is not None:
                state, ntok, k = last[0], last[1], 3 + last[2]
                tail = last[3:k]
                last = None
            self.misses += 1
            toks = tail + tuple(self.codec.encode(chunk))
            ntok += len(toks) - len(tail)
            full = len(toks) // bs
            made: list[int] = []
            for i in range(full):
                state, ext = scheme.block(
                    state, toks[i * bs : (i + 1) * bs], not out and not made, salt
                )
                made.append(ext)
            tail = toks[full * bs :]
            cache[key] = (state, ntok, len(tail), *tail, *made)
            if len(cache) > self.max_chunks:
                cache.popitem(last=False)
            extend(made)
        self.hits += hits
        if last is not None:
            ntok = last[1]
        return out, ntok

    def tokens(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids, uncached (for tests and tools)."""
        p = self.codec.prompt(body)
        if p is None or isinstance(p, list):
            return p
        return list(p[0]) + self.codec.encode(p[1])


def block_hashes_of(
    codec: PromptCodec, scheme: HashScheme, body: Mapping[str, Any], block_size: int = 16
) -> Sequence[int] | None:
    """Uncached reference: tokenize the whole prompt, then hash (the engine's way)."""
    pb = PromptBlocks(codec, scheme, block_size)
    toks = pb.tokens(body)
    if toks is None:
        return None
    salt = body.get("cache_salt")
    return scheme.hashes(toks, block_size, salt if isinstance(salt, str) and salt else None)
