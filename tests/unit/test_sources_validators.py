"""Which conditional headers a ranged HTTP GET sends, and which answers mean a changed file."""

from __future__ import annotations

import pytest

from preheat.errors import OriginChanged
from preheat.sources.base import Location
from preheat.sources.http import check_answer, conditions

STRONG = Location("http://h/f", "fp", etag='"5f-1a"', modified="Mon, 01 Dec 2026 09:00:00 GMT")
WEAK = Location("http://h/f", "fp", etag='W/"5f-1a"', modified="Mon, 01 Dec 2026 09:00:00 GMT")
DATED = Location("http://h/f", "fp", modified="Mon, 01 Dec 2026 09:00:00 GMT")
BARE = Location("http://h/f", "fp")


def test_conditions_prefer_a_strong_etag_then_the_date() -> None:
    """A strong ETag is sent as If-Match; a weak one (never matches If-Match) or none
    falls back to If-Unmodified-Since; with neither, the GET is unconditional."""
    assert conditions(STRONG) == {"If-Match": '"5f-1a"'}
    assert conditions(WEAK) == {"If-Unmodified-Since": "Mon, 01 Dec 2026 09:00:00 GMT"}
    assert conditions(DATED) == {"If-Unmodified-Since": "Mon, 01 Dec 2026 09:00:00 GMT"}
    assert conditions(BARE) == {}


@pytest.mark.parametrize(
    ("loc", "status", "headers", "says"),
    [
        (STRONG, 412, {}, "412"),
        (STRONG, 206, {"etag": '"60-1a"'}, 'ETag "5f-1a" is now "60-1a"'),
        (STRONG, 200, {"etag": '"60-1a"'}, "ETag"),  # an If-Range style whole new body
        (DATED, 206, {"last-modified": "Mon, 01 Dec 2026 09:00:07 GMT"}, "Last-Modified"),
    ],
)
def test_changed_answers_are_origin_changed(
    loc: Location, status: int, headers: dict[str, str], says: str
) -> None:
    """412, or a 200/206 whose validator differs from the pinned one, is OriginChanged
    naming the file and what changed."""
    with pytest.raises(OriginChanged, match="changed at the origin") as err:
        check_answer(loc, "http://h/f", status, headers)
    assert says in str(err.value) and "http://h/f" in str(err.value)


@pytest.mark.parametrize(
    ("loc", "status", "headers"),
    [
        (STRONG, 206, {"etag": '"5f-1a"'}),
        (WEAK, 206, {"etag": '"5f-1a"'}),  # weak comparison: same tag, other strength
        (STRONG, 206, {}),  # an answer without validators cannot be compared
        (BARE, 206, {"etag": '"anything"'}),  # nothing pinned at resolve
        (STRONG, 404, {"etag": '"other"'}),  # not a body: the status check handles it
    ],
)
def test_matching_or_uncomparable_answers_pass(
    loc: Location, status: int, headers: dict[str, str]
) -> None:
    """The same validator, or none to compare, lets the answer through."""
    check_answer(loc, "http://h/f", status, headers)
