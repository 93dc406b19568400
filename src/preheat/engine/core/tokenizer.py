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

Cost: steps 2 and 3 are one regex (``_TOKENS``) whose matches are exactly the chunks:
a run of word or punctuation characters is cut every 6, a single whitespace character
before one opens its first chunk, and a longer whitespace run (one not preceded by
whitespace opens it) is its own chunks. Faster still, an ASCII text in which no
whitespace touches a space is cut at its spaces (``str.split``): each space then opens
a piece, so every word with its leading space tokenizes alone, and a dictionary of word
-> ids (bounded; see ``_Words``) answers the words it has seen. The ids are
identical (tests/unit/test_tokenizer.py checks them against the step-by-step algorithm
over a corpus).

Decoding is not needed (the engine's output is filler text whose tokens it knows).
"""

from __future__ import annotations

import re
import zlib

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
# The 6-character chunks of the pieces ``\s?\w+|\s?[^\w\s]+|\s+`` in one pass: a
# chunk inside a word or punctuation run, one opened by the single whitespace before
# such a run (whitespace preceded by whitespace is inside a ``\s+`` piece), or up to 6
# characters of a whitespace run.
_TOKENS = re.compile(r"\w{1,6}|[^\w\s]{1,6}|(?<!\s)\s\w{1,5}|(?<!\s)\s[^\w\s]{1,5}|\s{1,6}")
_MAX_IDS = 1 << 17
_MAX_WORDS = 1 << 16
_MAX_WORD = 64
# ASCII whitespace other than the space (str.isspace, as the regex's ``\s``), each with
# itself before and after a space.
_TOUCHING = tuple((c, c + " ", " " + c) for c in "\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f")
_SPECIAL = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

# Generated text: one token per word (each at most 6 characters with its space).
FILLER_WORDS: tuple[str, ...] = (
    " the", " data", " is", " warm", " and", " the", " cache", " is", " hot",
    " so", " we", " go", " on", ".",
)  # fmt: skip


def _chunk_id(chunk: str) -> int:
    return zlib.crc32(chunk.encode()) % _VOCAB + _FIRST_ID


class _Ids(dict[str, int]):
    """chunk -> id, filled on a miss; emptied when it reaches ``_MAX_IDS`` entries."""

    def __missing__(self, chunk: str) -> int:
        if len(self) >= _MAX_IDS:
            self.clear()
        i = self[chunk] = _chunk_id(chunk)
        return i


_IDS = _Ids()
_lookup = _IDS.__getitem__
_findall = _TOKENS.findall


class _Words(dict[str, tuple[int, ...]]):
    """word -> the ids of ``opening + word``: a word after a space (``_WORDS``) or a
    text's first word (``_FIRSTS``, which would otherwise run the regex per text);
    emptied at ``_MAX_WORDS`` entries, and words over ``_MAX_WORD`` characters are not
    kept (the memory bound: ~25 MB each)."""

    def __init__(self, opening: str) -> None:
        super().__init__()
        self.opening = opening

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = tuple(map(_lookup, _findall(self.opening + word)))
        if len(word) <= _MAX_WORD:
            if len(self) >= _MAX_WORDS:
                self.clear()
            self[word] = ids
        return ids


_WORDS = _Words(" ")
_word = _WORDS.__getitem__
_FIRSTS = _Words("")
_first = _FIRSTS.__getitem__


def _split_ok(text: str) -> bool:
    """True when every space in ``text`` opens a piece: ASCII, no whitespace next to one."""
    if not text.isascii() or "  " in text:
        return False
    if text.isprintable():  # ASCII printable: the space is its only whitespace
        return True
    # One fast scan per character kind; the pairs only for kinds present (most: "\n").
    return not any(c in text and (a in text or b in text) for c, a, b in _TOUCHING)


def _encode(text: str) -> list[int]:
    """The ids of a text without special tokens."""
    if not _split_ok(text):
        return list(map(_lookup, _findall(text)))
    # A plain loop: on PyPy, chain.from_iterable(map(...)) allocated 6.5 KB per aws-8k
    # question (its iterators and the list's regrowth) against 2.3 KB, at 4.5 -> 2.6 us;
    # CPython 4.5 -> 3.5 us (tests/unit/test_tokenizer.py keeps the ids).
    it = iter(text.split(" "))
    out = list(_first(next(it)))
    for word in it:
        out.extend(_word(word))
    return out


class Tokenizer:
    """Text to token ids; see the module docstring for the algorithm."""

    special_tokens = SPECIAL_TOKENS

    def encode(self, text: str) -> list[int]:
        if "<|" not in text:
            return _encode(text)
        out: list[int] = []
        for i, part in enumerate(_SPECIAL.split(text)):
            if i % 2 == 1:
                out.append(SPECIAL_TOKENS[part])
            elif part:
                out.extend(_encode(part))
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
