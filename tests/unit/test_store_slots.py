"""Connection slots: waiters are served by priority, and cancelled waiters give slots back."""

from __future__ import annotations

import asyncio

from preheat.store.fill import Slots


async def test_waiters_served_lowest_priority_first() -> None:
    """With one slot busy, queued waiters get it in (range, file) order, not arrival order."""
    slots = Slots(1)
    await slots.acquire((0, 0))
    order: list[tuple[int, int]] = []

    async def want(p: tuple[int, int]) -> None:
        async with slots.slot(p):
            order.append(p)

    tasks = [asyncio.create_task(want(p)) for p in [(2, 0), (0, 1), (1, 0), (0, 2)]]
    await asyncio.sleep(0)
    slots.release()
    await asyncio.gather(*tasks)
    assert order == [(0, 1), (0, 2), (1, 0), (2, 0)]


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    """A waiter cancelled while queued leaves the count intact."""
    slots = Slots(1)
    await slots.acquire((0, 0))
    waiter = asyncio.create_task(slots.acquire((1, 0)))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    slots.release()
    await asyncio.wait_for(slots.acquire((0, 0)), 1)  # the slot is free again
