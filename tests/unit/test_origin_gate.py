"""``runtime.peering.OriginGate``: the origin budget with peers off (real asyncio)."""

from __future__ import annotations

import asyncio

from preheat.control.fanout import Budget
from preheat.runtime.peering import OriginGate


async def test_replica_pulls_count_against_the_budget_and_never_wait() -> None:
    """With one slot held by a warm-up, a replica's pull takes one at once; a second
    warm-up waits (and hears why) until both have released theirs."""
    gate = OriginGate(Budget(concurrent_fills=1))
    heard: list[str] = []
    await asyncio.wait_for(gate.admit_origin("n0", "r1", heard.append), 1)
    await asyncio.wait_for(gate.admit_origin("n1", "r1", heard.append, wait=False), 1)
    assert gate.running == {("n0", "r1"), ("n1", "r1")}
    third = asyncio.create_task(gate.admit_origin("n2", "r2", heard.append))
    await asyncio.sleep(0.3)
    assert not third.done() and heard and "origin slot (2 origin fill(s) running)" in heard[-1]
    gate.release("n0", "r1")
    await asyncio.sleep(0.1)
    assert not third.done()  # the replica's pull still holds the only slot
    gate.release("n1", "r1")
    await asyncio.wait_for(third, 2)
    assert gate.running == {("n2", "r2")}


async def test_without_a_budget_one_origin_fill_per_revision() -> None:
    """No ``concurrentFills``: warm-ups of different revisions go at once, a second of the
    same revision waits for the first (``control.fanout.plan_fanout``'s default)."""
    gate = OriginGate(Budget())
    await asyncio.wait_for(gate.admit_origin("n0", "r1", lambda _w: None), 1)
    await asyncio.wait_for(gate.admit_origin("n0", "r2", lambda _w: None), 1)
    same = asyncio.create_task(gate.admit_origin("n1", "r1", lambda _w: None))
    await asyncio.sleep(0.3)
    assert not same.done()
    gate.release("n0", "r1")
    await asyncio.wait_for(same, 2)
