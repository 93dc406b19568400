"""A deterministic offline tokenizer: about 4 characters per token on English text.

It needs no vocabulary file and gives the same ids in every process, so the engine, the
router's tests and the simulator agree on prompt lengths and block boundaries.

Algorithm (GPT-2-style pre-tokenisation, then fixed-width pieces):

1. Special tokens (``<|begin_of_text|>`` and the other Llama-3 markers) are whole tokens
   with fixed ids.
2. The rest is split into words with their leading space, runs of punctuation, and runs
   of whitespace (``\\s?\\w+ | \\s?[^\\w\\s]+ | \\s+``).
3. Each piece is cut into chunks of at most 6 characters (``" hello"`` is one token,
   ``" caching"`` is ``" cachi"`` + ``"ng"``); on English prose that averages about 4.1
   characters per token, close to Llama-3's tokenizer.
4. A chunk's id is ``crc32(chunk) mod 126000 + 1000``: stable, well spread, cheap.

Decoding is not needed (the engine's output is filler text whose tokens it knows).
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache
from itertools import chain

__all__ = ["FILLER_IDS", "FILLER_WORDS", "SPECIAL_TOKENS", "Tokenizer", "filler_text"]

SPECIAL_TOKENS: dict[str, int] = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eom_id|>": 128008,
    "<|eot_id|>": 128009,
    "<|python_tag|>": 128010,
}
_VOCAB = 126_000
_FIRST_ID = 1000
_CHUNK = 6
_PIECES = re.compile(r"\s?\w+|\s?[^\w\s]+|\s+")
_SPECIAL = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

# Generated text: one token per word (each at most 6 characters with its space).
FILLER_WORDS: tuple[str, ...] = (
    " the", " data", " is", " warm", " and", " the", " cache", " is", " hot",
    " so", " we", " go", " on", ".",
)  # fmt: skip


@lru_cache(maxsize=65536)
def _chunk_id(chunk: str) -> int:
    return zlib.crc32(chunk.encode()) % _VOCAB + _FIRST_ID


@lru_cache(maxsize=16384)
def _piece_ids(piece: str) -> tuple[int, ...]:
    return tuple(_chunk_id(piece[i : i + _CHUNK]) for i in range(0, len(piece), _CHUNK))


class Tokenizer:
    """Text to token ids; see the module docstring for the algorithm."""

    special_tokens = SPECIAL_TOKENS

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        parts = _SPECIAL.split(text) if "<|" in text else [text]
        for i, part in enumerate(parts):
            if i % 2 == 1:
                out.append(SPECIAL_TOKENS[part])
                continue
            out.extend(chain.from_iterable(map(_piece_ids, _PIECES.findall(part))))
        return out

    def count(self, text: str) -> int:
        return len(self.encode(text))

    @staticmethod
    def filler_ids(start: int, n: int) -> list[int]:
        """Token ids of output tokens ``start`` .. ``start+n-1`` of any response."""
        ids = FILLER_IDS
        return [ids[(start + i) % len(ids)] for i in range(n)]


FILLER_IDS: tuple[int, ...] = tuple(_chunk_id(w) for w in FILLER_WORDS)
"""The token id of each filler word: output token ``k`` is ``FILLER_IDS[k % len]``."""


def filler_text(start: int, n: int) -> str:
    """The text of output tokens ``start`` .. ``start+n-1`` (one word per token)."""
    words = FILLER_WORDS
    return "".join(words[(start + i) % len(words)] for i in range(n))
