"""The one discrete-event core both simulators run on (sim/events.py)."""

from __future__ import annotations

import pytest

from preheat.sim import coldstart, coldstart_fleet, routing
from preheat.sim.events import Event, EventQueue


def test_event_queue_orders_by_time_then_fifo() -> None:
    """Events pop by time, equal times in scheduling order, and time never runs backwards."""
    q = EventQueue()
    q.at(2.0, "b")
    q.at(1.0, "a")
    q.at(2.0, "c")
    assert [q.pop()[1] for _ in range(3)] == ["a", "b", "c"]
    assert q.now == 2.0 and q.popped == 3
    with pytest.raises(ValueError, match="before now"):
        q.at(1.5, "late")


def test_events_unpack_and_name_their_fields() -> None:
    """A popped event unpacks as (time, kind, payload) and has the same named fields."""
    q = EventQueue(start=5.0)
    q.after(2.5, "flow", {"epoch": 3})
    assert q.peek_time() == 7.5 and len(q) == 1
    ev = q.pop()
    t, kind, payload = ev
    assert ev == Event(7.5, "flow", {"epoch": 3})
    assert (t, kind, payload) == (ev.time, ev.kind, ev.payload) == (7.5, "flow", {"epoch": 3})
    assert q.peek_time() is None and q.now == 7.5


def test_negative_delay_means_now_and_payloads_are_never_compared() -> None:
    """``after`` clamps a negative delay to now; equal-time events with uncomparable
    payloads pop in scheduling order without comparing them."""
    q = EventQueue(start=1.0)
    q.after(-3.0, "x", object())
    q.at(1.0, "y", object())
    assert [q.pop().kind for _ in range(2)] == ["x", "y"]
    assert q.now == 1.0


def test_both_simulators_share_this_queue() -> None:
    """The routing and cold-start simulators import this one queue, no other event core."""
    assert routing.EventQueue is EventQueue
    assert coldstart.EventQueue is EventQueue and coldstart_fleet.EventQueue is EventQueue
