"""``PrefixHasher.cuts`` follows its rule: a cut every ``block_chars`` from the previous
cut, at a message end at least ``MIN_CUT`` past it, and at the end of the prefix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.router.prefix import MIN_CUT, PrefixHasher


def _rule(n: int, boundaries: list[int], bc: int) -> list[int]:
    """The rule, one character at a time."""
    out: list[int] = []
    ends = {b for b in boundaries if b < n}
    for i in range(1, n + 1):
        last = out[-1] if out else 0
        if i - last == bc or i == n or (i in ends and i - last >= MIN_CUT):
            out.append(i)
    return out


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 9000),
    boundaries=st.lists(st.integers(0, 9500), max_size=8).map(sorted),
    bc=st.sampled_from([512, 777, 2048]),
)
def test_cuts_follow_the_rule(n: int, boundaries: list[int], bc: int) -> None:
    """Sorted message ends (some past the prefix) give the rule's cuts."""
    assert PrefixHasher(b"cuts-test-salt-0123", bc).cuts(n, boundaries) == _rule(n, boundaries, bc)
