"""The decision-cost shortcuts give what the plain computations give."""

from __future__ import annotations

import random

from preheat.bench.workloads import WORKLOADS
from preheat.engine.core.chat import render_chat
from preheat.router.kvprompt import _chunks

_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def _chunks_by_loop(text: str, size: int) -> list[str]:
    """The chunker as a plain loop (the code before the regular expression)."""
    out = []
    pos = 0
    n = len(text)
    while pos < n:
        end = text.find(" ", pos + size) if pos + size < n else -1
        while end != -1 and not (text[end - 1] in _LETTERS and text[end + 1 : end + 2] in _LETTERS):
            end = text.find(" ", end + 1)
        if end == -1:
            end = n
        out.append(text[pos:end])
        pos = end
    return out


def test_the_prompt_chunker_cuts_where_the_plain_loop_cuts() -> None:
    """Random texts of letters, spaces, newlines and punctuation, and real chat prompts,
    are cut at the same places by the regular expression as by the loop."""
    rng = random.Random(1)
    alphabet = "ab Z \n.\u00e9,  x1"
    for _ in range(800):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))
        for size in (1, 2, 7, 40, 256, 1 << 62):
            assert _chunks(text, size) == _chunks_by_loop(text, size), (text, size)
    for w in WORKLOADS["rag_chat"](40, seed=2):
        text = render_chat(w.body["messages"])
        assert _chunks(text, 256) == _chunks_by_loop(text, 256)
        assert "".join(_chunks(text, 256)) == text
