"""``prefix_aware`` keeps its recent-count order only when ``learned`` reads it: the order it
sorts when read stale is the one the eager ``remove`` + ``insort`` would have kept."""

from __future__ import annotations

import random
from bisect import insort

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.router.policies import Instance, PolicyParams, RouteRequest, make_policy

SALT = b"order-test-salt-0123456789"


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 6),
    switches=st.lists(st.sampled_from(["stable", "learned", "hybrid", "hash"]), max_size=6),
    seed=st.integers(0, 1000),
)
def test_stale_order_sorts_to_what_insort_kept(n: int, switches: list[str], seed: int) -> None:
    """Switching placements (a config reload) over 400 decisions, with a window of 10 so
    the counts are rescaled twice, the order ``learned`` reads equals the eager one."""
    fleet = [Instance(f"http://10.2.0.{i}:8000") for i in range(n)]
    params = PolicyParams(placement="stable", balance_window=10)
    policy = make_policy("prefix_aware", params, salt=SALT, rng=random.Random(seed))
    rng = random.Random(seed)
    # The reference: the eager bookkeeping, fed the choices the policy made.
    rl = [0.0] * n
    order = list(range(n))
    g = 1.0
    plan = [*switches, "learned"]
    placement = "stable"
    for k in range(400):
        if k % 60 == 0 and k // 60 < len(plan):
            placement = plan[k // 60]
            policy.params = PolicyParams(placement=placement, balance_window=10)  # type: ignore[attr-defined]
        for inst in fleet:
            inst.in_flight = rng.randrange(3)
        req = RouteRequest(f"r{k}", text=f"doc {rng.randrange(8)} " * 300)
        c = policy.choose(req, fleet)
        policy.on_sent(req, c)
        if placement == "hash":  # counts nothing
            continue
        g /= 1.0 - 1.0 / 10
        j = fleet.index(c.instance)
        rl[j] += g
        order.remove(j)
        insort(order, j, key=rl.__getitem__)
        if g > 1e12:
            rl = [x / g for x in rl]
            g = 1.0
        if k % 37 == 0:
            assert policy._ordered() == order  # type: ignore[attr-defined]
            assert policy._rl == rl  # type: ignore[attr-defined]
    assert policy._ordered() == order  # type: ignore[attr-defined]
