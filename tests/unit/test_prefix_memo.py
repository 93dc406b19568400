"""PrefixHasher.remember_parts: keys of prefixes built from the same strings, reused."""

from __future__ import annotations

import random
from typing import Any

import pytest

from preheat.errors import ConfigError
from preheat.router.prefix import PrefixHasher, PrefixKey, canonical_parts

SALT = b"0123456789abcdef-test-salt"


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnopq\u00e9") for _ in range(n))


def _body(system: str, question: str, model: str = "m") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }


def _key(h: PrefixHasher, body: dict[str, Any], prefix_length: int = 8192) -> PrefixKey:
    parts, ends, total = canonical_parts(body)
    return h.chain_parts(
        parts, total, prefix_length, boundaries=ends, model=body["model"], cache_salt=None
    )


def test_remembered_keys_equal_plain_keys_over_a_stream_of_shared_prefixes() -> None:
    """Over 300 requests of 5 shared system prompts (prefixes 1,024-65,536 characters,
    some past the system prompt), every key equals a plain hasher's, and the keys of
    prefixes within the system prompt are reused (the same chain object)."""
    systems = [_text(3000 + 4000 * f, f) for f in range(5)]
    plain, memo = PrefixHasher(SALT), PrefixHasher(SALT)
    memo.remember_parts(16)
    rng = random.Random(7)
    reused = 0
    for i in range(300):
        system = systems[rng.randrange(5)]
        body = _body(system, _text(200, 100 + i), model=rng.choice(("m", "n")))
        pl = rng.choice((1024, 4096, 8192, 65536))
        first, again = _key(memo, body, pl), _key(memo, body, pl)
        assert first == again == _key(plain, body, pl)
        reused += again.chain is first.chain
    assert 0 < reused < 300  # the 65,536-character prefixes hold the question: not kept


def test_equal_text_in_new_strings_is_hashed_again_with_the_same_key() -> None:
    """A body whose system prompt is an equal but new string (the proxy's case) is not a
    memo hit: its key is computed again and equals the first."""
    memo = PrefixHasher(SALT)
    memo.remember_parts(4)
    system = _text(9000, 1)
    a = _key(memo, _body(system, "q1"))
    b = _key(memo, _body("".join(list(system)), "q2"))
    assert a == b
    assert a.chain is not b.chain
    assert _key(memo, _body(system, "q3")).chain is a.chain


def test_a_prefix_that_reaches_the_last_message_is_not_remembered() -> None:
    """A short system prompt whose question falls inside the prefix is hashed every time."""
    memo = PrefixHasher(SALT)
    memo.remember_parts(4)
    body = _body(_text(500, 2), _text(300, 3))
    a, b = _key(memo, body), _key(memo, body)
    assert a == b and a.chain is not b.chain


def test_the_memo_keeps_at_most_its_entries_least_recent_out_first() -> None:
    """With 2 entries, a third prefix evicts the least recently used one."""
    memo = PrefixHasher(SALT)
    memo.remember_parts(2)
    s = [_text(9000, 10 + f) for f in range(3)]
    k0, k1 = _key(memo, _body(s[0], "q")), _key(memo, _body(s[1], "q"))
    assert _key(memo, _body(s[0], "r")).chain is k0.chain  # s[0] is now the most recent
    _key(memo, _body(s[2], "q"))  # evicts s[1]
    assert _key(memo, _body(s[0], "t")).chain is k0.chain
    again = _key(memo, _body(s[1], "q"))
    assert again == k1 and again.chain is not k1.chain


def test_remember_parts_rejects_a_negative_size_and_zero_turns_it_off() -> None:
    """A negative size is a ConfigError; 0 hashes every prompt again."""
    memo = PrefixHasher(SALT)
    with pytest.raises(ConfigError, match="negative"):
        memo.remember_parts(-1)
    memo.remember_parts(4)
    memo.remember_parts(0)
    body = _body(_text(9000, 4), "q")
    assert _key(memo, body).chain is not _key(memo, body).chain
