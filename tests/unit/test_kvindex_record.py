"""The learned index's ``record``: blocks known before an instance's capacity count once
it is learned, and the holders, use and evictions follow the LRU model."""

from __future__ import annotations

from preheat.router.kvindex import CAPACITY_SLACK, CapacityIndex


def test_blocks_recorded_before_the_capacity_enter_the_model_when_sent_again() -> None:
    """A chain recorded with no capacity known is weighed when recorded again after it is
    learned, and a later flood evicts it (root last) as the LRU says."""
    ix = CapacityIndex(1000, 4)
    ix.record([1, 2, 3], "a", [100, 100, 100])
    assert ix.used("a") == 0 and ix.holders(3) == ("a",)
    ix.set_capacity("a", 400)
    ix.record([1, 2, 3], "a", [100, 100, 100], tail_tokens=20)
    assert ix.used("a") == 320
    ix.record([1, 2, 3], "a", [100, 100, 100])  # already modelled: weighed once
    assert ix.used("a") == 320
    ix.record([7], "a", [250])  # 570 > 400 x 1.25 = 500: the tail, then block 3 go
    assert ix.used("a") == 450 <= 400 * CAPACITY_SLACK
    assert ix.holders(3) == () and ix.holders(2) == ("a",) and ix.holders(7) == ("a",)
    assert ix.evicted_blocks == 1


def test_an_evicted_holder_leaves_the_others_in_order() -> None:
    """Evicting one of several holders of a block keeps the others, oldest first; a
    holder past ``max_holders`` drops the oldest and its modelled use."""
    ix = CapacityIndex(1000, 3)
    ix.set_capacity("b", 100)
    for x in ("a", "b", "c"):
        ix.record([5], x, [60])
    assert ix.holders(5) == ("a", "b", "c")
    ix.record([6], "b", [70])  # b: 130 > 125, so block 5 goes from b
    assert ix.holders(5) == ("a", "c") and ix.used("b") == 70
    ix.record([6], "d", [70])
    ix.record([6], "e", [70])
    ix.record([6], "f", [70])  # four holders: b, the oldest, is dropped
    assert ix.holders(6) == ("d", "e", "f") and ix.used("b") == 0
