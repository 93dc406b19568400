"""Canonical prompt text, keyed chained block hashes and rendezvous scores."""

from __future__ import annotations

import random

import pytest

from preheat.errors import ConfigError
from preheat.router.prefix import (
    PrefixHasher,
    canonical,
    canonical_text,
    check_prefix_length,
    rank,
)

SALT = b"0123456789abcdef-test-salt"


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnopq") for _ in range(n))


def test_chat_roles_tools_and_fields_change_the_canonical_text() -> None:
    """Role, name, tools and chat-template fields are part of the text; model is not."""
    base = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    }
    swapped = {
        "messages": [{"role": "user", "content": "be brief"}, {"role": "user", "content": "hi"}]
    }
    tools = {**base, "tools": [{"type": "function", "function": {"name": "f"}}]}
    kwargs = {**base, "chat_template_kwargs": {"enable_thinking": False}}
    texts = {canonical_text(b) for b in (base, swapped, tools, kwargs)}
    assert len(texts) == 4
    assert canonical_text({**base, "model": "x", "temperature": 0.1}) == canonical_text(base)


def test_content_parts_and_completion_prompts() -> None:
    """List content joins text parts; completion prompts may be strings or token ids."""
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    }
    plain = {"messages": [{"role": "user", "content": "ab"}]}
    assert canonical_text(parts) == canonical_text(plain)
    assert canonical_text({"prompt": "hello"}) == "hello"
    assert canonical_text({"prompt": ["hello", "other"]}) == "hello"
    assert canonical_text({"prompt": [1, 2, 3]}) == "1,2,3"
    text, ends = canonical(plain)
    assert ends == [len(text)]


def test_a_body_without_prompt_or_messages_is_rejected() -> None:
    """The error says what is missing."""
    with pytest.raises(ConfigError, match="neither 'messages' nor 'prompt'"):
        canonical_text({"model": "m"})
    with pytest.raises(ConfigError, match="must be a list"):
        canonical_text({"messages": "hi"})


def test_prefix_length_bounds_name_the_value() -> None:
    """1,024-65,536 characters, as SageMaker's PrefixLength."""
    assert check_prefix_length(1024) == 1024
    with pytest.raises(ConfigError, match="100 is outside 1024-65536"):
        check_prefix_length(100)
    with pytest.raises(ConfigError, match="not an integer"):
        check_prefix_length("8k")  # type: ignore[arg-type]


def test_chain_hashes_equal_prefixes_equally_and_stop_at_the_first_difference() -> None:
    """Block i's hash depends on all text up to block i, and only on it."""
    h = PrefixHasher(SALT, block_chars=1024)
    a = _text(8000)
    b = a[:5000] + "X" + a[5001:]
    ka, kb = h.chain(a, 65536), h.chain(b, 65536)
    assert len(ka.chain) == 8
    assert ka.chain[:4] == kb.chain[:4]  # blocks 0-3 end at 4096 < 5000
    assert all(x != y for x, y in zip(ka.chain[4:], kb.chain[4:], strict=True))
    # Only prefix_length characters count.
    assert h.chain(a, 4096).key == h.chain(a[:4096] + "different tail", 4096).key


def test_the_salt_and_the_model_key_the_hashes() -> None:
    """Another salt, model or cache_salt gives unrelated keys; a short salt is refused."""
    t = _text(3000)
    k = PrefixHasher(SALT).chain(t, 8192).key
    assert PrefixHasher(SALT + b"2").chain(t, 8192).key != k
    assert PrefixHasher(SALT).chain(t, 8192, model="m").key != k
    assert PrefixHasher(SALT).chain(t, 8192, cache_salt="tenant").key != k
    with pytest.raises(ConfigError, match="at least 16"):
        PrefixHasher(b"short")


def test_a_later_chat_turn_repeats_the_earlier_turns_hashes() -> None:
    """Cuts at message ends make turn 2's chain contain turn 1's key."""
    h = PrefixHasher(SALT)
    msgs = [
        {"role": "system", "content": "You are helpful. " * 20},
        {"role": "user", "content": _text(700, 1)},
    ]
    t1, e1 = canonical({"messages": msgs})
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": _text(400, 2)},
        {"role": "user", "content": "more?"},
    ]
    t2, e2 = canonical({"messages": msgs2})
    k1 = h.chain(t1, 8192, boundaries=e1)
    k2 = h.chain(t2, 8192, boundaries=e2)
    assert k1.key in k2.chain
    assert k1.key != k2.key


def test_non_ascii_text_hashes_like_its_characters() -> None:
    """Blocks are cut in characters, also for text outside ASCII."""
    h = PrefixHasher(SALT, block_chars=512)
    t = "é" * 1500
    k = h.chain(t, 8192)
    assert len(k.chain) == 3 and k.prefix_chars == 1500
    assert h.chain(t + "ü", 8192).chain[:2] == k.chain[:2]


def test_keys_hold_no_text() -> None:
    """A PrefixKey is integers and lengths only."""
    k = PrefixHasher(SALT).chain("secret system prompt " * 100, 8192)
    assert "secret" not in repr(k)
    assert all(isinstance(x, int) and 0 <= x < 2**64 for x in k.chain)


def test_rendezvous_spreads_keys_evenly_and_moves_about_one_in_n() -> None:
    """Each of 7 seeds is first for ~1/7 of keys; dropping one moves only its keys."""
    h = PrefixHasher(SALT)
    seeds = [h.seed(f"http://10.0.0.{i}:8000") for i in range(7)]
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(14000)]
    firsts = [rank(k, seeds)[0] for k in keys]
    counts = [firsts.count(i) for i in range(7)]
    assert max(counts) < 1.1 * 2000 and min(counts) > 0.9 * 2000
    fewer = seeds[:6]
    moved = sum(
        1 for k, f in zip(keys, firsts, strict=True) if seeds[f] != fewer[rank(k, fewer)[0]]
    )
    assert moved == counts[6]
    more = [*seeds, h.seed("http://10.0.0.99:8000")]
    moved_add = sum(1 for k, f in zip(keys, firsts, strict=True) if rank(k, more)[0] != f)
    assert moved_add <= 1.1 * len(keys) / 8
