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
    assert 0 < reused < 300  # a prefix holding the question is hashed from its start on


def test_equal_text_in_new_strings_gives_the_remembered_key() -> None:
    """A body whose system prompt is an equal but new string (the proxy's case) finds the
    remembered key: the memo is keyed by the text, so equal text is the same entry."""
    memo = PrefixHasher(SALT)
    memo.remember_parts(4)
    system = _text(9000, 1)
    a = _key(memo, _body(system, "q1"))
    b = _key(memo, _body("".join(list(system)), "q2"))
    assert a == b
    assert b.chain is a.chain


def test_prefixes_past_the_last_message_start_equal_plain_keys() -> None:
    """Short system prompts whose questions fall inside the prefix (only the hash state at
    the question's start is remembered): 400 keys equal a plain hasher's, ASCII or not."""
    plain, memo = PrefixHasher(SALT), PrefixHasher(SALT)
    memo.remember_parts(3)  # fewer than the 4 prompts: entries are evicted and rebuilt
    rng = random.Random(5)
    systems = [_text(300 + 1500 * f, 20 + f) for f in range(4)]
    for i in range(400):
        question = _text(rng.randrange(1, 3000), 200 + i)
        body = _body(systems[rng.randrange(4)], question)
        pl = rng.choice((1024, 4096, 8192))
        assert _key(memo, body, pl) == _key(plain, body, pl)


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
