"""``chain_parts`` feeds the parts one by one (slicing only where a cut splits one) and
gets the hashes of the joined text's blocks, each hashed as its UTF-8 bytes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.router.prefix import PrefixHasher, _u64

_PIECES = st.sampled_from(["", "a", "word ", "é", "\ud800", "x" * 300, "y" * 2047, "🙂z"])
_PARTS = st.lists(st.lists(_PIECES, max_size=6).map("".join), min_size=1, max_size=8)


def _reference(h: PrefixHasher, text: str, n: int, boundaries: list[int]) -> tuple[int, ...]:
    """Block by block over the joined text, as the chain is defined."""
    state = h._start(None, None)
    out, last = [], 0
    for c in h.cuts(n, boundaries):
        state.update(text[last:c].encode("utf-8", "surrogatepass"))
        out.append(_u64(state.digest())[0])
        last = c
    return tuple(out)


@settings(max_examples=300, deadline=None)
@given(parts=_PARTS, prefix_length=st.sampled_from([1024, 2048, 3000, 8192]))
def test_parts_hash_like_the_joined_text(parts: list[str], prefix_length: int) -> None:
    """Any parts (empty ones, non-ASCII, lone surrogates, cuts inside and between parts)
    give the joined text's chain."""
    h = PrefixHasher(b"preheat-test-salt-16b", block_chars=512)
    text = "".join(parts)
    ends, pos = [], 0
    for p in parts:
        pos += len(p)
        ends.append(pos)
    n = min(len(text), prefix_length)
    key = h.chain_parts(parts, len(text), prefix_length, boundaries=ends)
    if n:
        assert key.chain == _reference(h, text, n, ends)
    assert key == h.chain(text, prefix_length, boundaries=ends)
