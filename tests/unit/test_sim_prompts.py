"""The simulator's prompt builder: its memo and parts table give the engine's exact tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.bench.routing import prompt_tokens
from preheat.bench.workloads import WORKLOADS
from preheat.engine.core.chat import render_chat
from preheat.engine.core.tokenizer import SPECIAL_TOKENS, Tokenizer
from preheat.kvcache import block_hashes
from preheat.sim import prompts
from preheat.sim.prompts import PromptBuilder

# Text with the tokenizer's hard cases: special tokens inside content, a lone "<|",
# runs of whitespace and punctuation, non-ASCII letters.
_ATOMS = st.sampled_from(
    [*SPECIAL_TOKENS, "<|", "|>", " ", "\n\n", "  ", "word", " caching", "!?", "é", "x" * 70]
)
_TEXT = st.lists(_ATOMS, max_size=12).map("".join)
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": _TEXT}
    ),
    min_size=1,
    max_size=4,
)


def test_every_workload_gets_the_engines_tokens_with_a_full_parts_table(monkeypatch) -> None:
    """Every workload's bodies give the engine's tokens and hashes, twice over (memo and
    parts-table hits), with a parts table small enough to be emptied many times."""
    monkeypatch.setattr(prompts, "_PARTS_MAX", 3)
    b = PromptBuilder(memo_tokens=50_000)
    for name in sorted(WORKLOADS):
        work = WORKLOADS[name](30, seed=5)
        for w in [*work, *work]:
            p = b.build(w.path, w.body)
            ref = prompt_tokens(w)
            assert list(p.tokens) == ref, (name, w.request_id)
            assert list(p.hashes) == block_hashes(ref), (name, w.request_id)


@settings(max_examples=150, deadline=None)
@given(convs=st.lists(_MESSAGES, min_size=1, max_size=3))
def test_chat_tokens_equal_one_encode_of_the_rendered_prompt(convs) -> None:
    """For any messages (special tokens and "<|" in the content included), the builder's
    tokens equal ``Tokenizer.encode`` of the whole rendered prompt, cold and memoised."""
    b = PromptBuilder()
    tok = Tokenizer()
    for messages in [*convs, *convs]:
        p = b.build(None, {"messages": messages})
        assert list(p.tokens) == tok.encode(render_chat(messages))


def test_bodies_off_the_plain_path_get_the_rendered_prompts_tokens() -> None:
    """Tools, tool calls, content parts, a salt, and a content with special tokens after
    the same conversation was memoised plain: each gives the tokens and hashes of the
    rendered prompt, as the engine computes them."""
    tok = Tokenizer()
    system = {"role": "system", "content": "You are terse. " * 30}
    user = {"role": "user", "content": "What is the cache?"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    b = PromptBuilder()
    bodies = [
        {"messages": [system, user]},
        {"messages": [system, user], "tools": [tool]},
        {"messages": [system, user], "tools": []},
        {"messages": [system, {"role": "assistant", "content": "", "tool_calls": [{"id": 1}]}]},
        {"messages": [system, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [system, user], "cache_salt": "tenant-a"},
        {"messages": [system, {"role": "user", "content": "a<|eot_id|>b <| c"}]},
        {"messages": [system, user]},
    ]
    for body in bodies:
        p = b.build(None, body)
        text = render_chat(body["messages"], body.get("tools"))
        assert list(p.tokens) == tok.encode(text)
        assert list(p.hashes) == block_hashes(list(p.tokens), salt=body.get("cache_salt"))


def test_plain_contents_opening_with_whitespace_get_the_engines_tokens() -> None:
    """A plain message's content is encoded apart from the "\\n\\n" before it unless it
    opens with whitespace (which that token absorbs): contents opening with each kind of
    whitespace (ASCII, control separators, Unicode spaces), with none, empty, and the same
    first word in many texts give the tokens of one ``encode`` of the rendered prompt."""
    b = PromptBuilder()
    tok = Tokenizer()
    openings = ["", " ", "  ", "\t", "\n", "\r\n", "\x0b", "\x1c", "\xa0", "\u3000", "x", "!"]
    for i, lead in enumerate(openings * 2):
        for content in (lead, lead + "word caching", lead + f"first{i % 3} words after"):
            messages = [
                {"role": "system", "content": "shared system prompt " * 8},
                {"role": "user", "content": content},
            ]
            p = b.build(None, {"messages": messages})
            assert list(p.tokens) == tok.encode(render_chat(messages)), repr(content)
