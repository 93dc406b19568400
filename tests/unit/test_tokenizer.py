"""The offline tokenizer and the Llama-3 chat template."""

from __future__ import annotations

import pytest

from preheat.engine.core.chat import render_chat
from preheat.engine.core.tokenizer import SPECIAL_TOKENS, Tokenizer, filler_text
from preheat.errors import ConfigError

ENGLISH = (
    "Prefix caching lets an inference server reuse the attention keys and values it "
    "computed for an earlier request whose prompt starts the same way. Routers that know "
    "this send requests sharing a long system prompt or document to the same replica, "
    "which cuts the time to first token and saves compute for everyone else. "
) * 20


def test_about_four_characters_per_token_on_english() -> None:
    """English prose costs roughly 4 characters per token."""
    n = Tokenizer().count(ENGLISH)
    assert 3.3 < len(ENGLISH) / n < 4.7


def test_deterministic_and_prefix_stable() -> None:
    """Same text, same ids; a shared text prefix gives a shared token prefix."""
    t = Tokenizer()
    a = t.encode("The quick brown fox jumps over the lazy dog.")
    assert a == t.encode("The quick brown fox jumps over the lazy dog.")
    b = t.encode("The quick brown fox jumps over the lazy dog. And more.")
    assert b[: len(a)] == a


def test_special_tokens_are_single_ids() -> None:
    """Template markers map to their fixed Llama-3 ids."""
    ids = Tokenizer().encode("<|begin_of_text|>hi<|eot_id|>")
    assert ids[0] == SPECIAL_TOKENS["<|begin_of_text|>"]
    assert ids[-1] == SPECIAL_TOKENS["<|eot_id|>"]
    assert len(ids) == 3


def test_filler_is_one_token_per_word() -> None:
    """Generated filler text re-encodes to exactly the ids the engine produced."""
    text = filler_text(3, 20)
    assert Tokenizer().encode(text) == Tokenizer.filler_ids(3, 20)


def test_chat_template_llama3_shape() -> None:
    """Messages render with header markers and an open assistant turn."""
    text = render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chat_content_parts_and_tools_change_prompt() -> None:
    """Text parts join; tools enter the system turn so they change the prompt."""
    parts = render_chat(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert "\n\nab<|eot_id|>" in parts
    tool = {"type": "function", "function": {"name": "f"}}
    with_tools = render_chat([{"role": "user", "content": "x"}], tools=[tool])
    assert '"name": "f"' in with_tools
    assert with_tools != render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "x"}, 3], "messages[1]"),
    ],
)
def test_chat_bad_input_names_field(messages: object, field: str) -> None:
    """Malformed messages raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        render_chat(messages)  # type: ignore[arg-type]


def _reference_encode(text: str) -> list[int]:
    """The algorithm of the module header step by step: pieces, 6-character chunks, crc32."""
    import re
    import zlib

    out: list[int] = []
    for i, part in enumerate(re.split("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")", text)):
        if i % 2 == 1:
            out.append(SPECIAL_TOKENS[part])
            continue
        for piece in re.findall(r"\s?\w+|\s?[^\w\s]+|\s+", part):
            for j in range(0, len(piece), 6):
                out.append(zlib.crc32(piece[j : j + 6].encode()) % 126_000 + 1000)
    return out


def test_one_pass_encoding_gives_the_reference_ids() -> None:
    """The single-regex encoder gives exactly the piece-then-chunk ids on a varied corpus."""
    import random

    rng = random.Random(7)
    alphabet = ["a", "Z", "9", "_", " ", "  ", "\t", "\n", ".", ",", "!?", "é", "ß", "日本",
                "\u00a0", "\u2003", "-", "'", "\"", "<|", "|>", "<|eot_id|>", "x" * 13,
                " " * 7, " " * 13, "." * 9, "\r\n"]  # fmt: skip
    corpus = [ENGLISH, filler_text(0, 200), "", " ", "       hello", "a      b", "a" * 20]
    corpus += ["x " + "y" * 100 + " z", "x " + "y" * 100 + " z"]  # a word too long to keep
    corpus += [render_chat([{"role": "user", "content": ENGLISH[:500]}])]
    ascii_only = [a for a in alphabet if a.isascii()]
    for _ in range(400):
        corpus.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))))
        words = (rng.choice(ascii_only) for _ in range(rng.randrange(1, 40)))
        corpus.append(" ".join(words))
        # Single spaces between words: the split-at-spaces path.
        prose = ["hello", "a", "Z9_", "x" * 13, ".", "!?", "end.\nNext", "(ok)", "<|", "it's"]
        line = " ".join(rng.choice(prose) for _ in range(rng.randrange(1, 40)))
        corpus.append(rng.choice(["", " "]) + line + rng.choice(["", " ", "\n"]))
    t = Tokenizer()
    for text in corpus:
        assert t.encode(text) == _reference_encode(text), repr(text)
