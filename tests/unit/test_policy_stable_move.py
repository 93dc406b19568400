"""The ``stable-move`` placement: a heavy cold block on an overloaded instance is re-homed
once, to its rendezvous order's first instance at or below the mean; ``stable`` itself
is unchanged."""

from __future__ import annotations

import random

from preheat.bench.workloads import WORKLOADS
from preheat.router.policies import Instance, PolicyParams, PrefixAwarePolicy, RouteRequest
from preheat.router.policies.stable_load import SessionLoad
from preheat.router.policies.stable_move import Moves
from preheat.router.policies.stable_traffic import BlockTraffic
from preheat.router.prefix import MASK64, SCORE_MULTIPLIER, PrefixHasher
from preheat.sim.routing import RoutingConfig, SimItem, simulate_routing
from preheat.timing import get_profile

SALT = b"stable-move-test-salt-0123456789"


def _run(placement: str) -> tuple[float, float]:
    """(KV hit rate, max share over the mean) of 4 engines under KV pressure (600 blocks
    each) on the RAG + chat stream whose three hottest documents start on one engine."""
    items = [
        SimItem(w.request_id, None, w.body, w.after) for w in WORKLOADS["rag_chat"](600, seed=2)
    ]
    cfg = RoutingConfig(
        instances=4,
        profile=get_profile("llama-3.1-70b-8xh100"),
        policy="prefix_aware",
        params=PolicyParams(placement=placement),
        kv_blocks=600,
        concurrency=14,
    )
    out = simulate_routing(
        items, cfg, policy_rng=random.Random(2), arrival_rng=random.Random(3)
    ).summary()
    return float(out["kv_hit_rate"]), float(out["max_share_over_mean"])


def test_move_keeps_the_share_bound_where_stable_misses_it_at_its_hit_rate() -> None:
    """Where ``stable`` leaves one engine 1.2x the mean, ``stable-move`` keeps every
    engine within 1.10x and loses less than 0.005 of the hit rate."""
    hit, share = _run("stable")
    assert share > 1.15
    hit_m, share_m = _run("stable-move")
    assert share_m <= 1.10
    assert hit_m >= hit - 0.005


def _state() -> tuple[PrefixHasher, BlockTraffic, SessionLoad, int, list[str]]:
    """Block counts and loads where one heavy document's block sits on overloaded "a"."""
    h = PrefixHasher(SALT, 2048)
    traffic, load = BlockTraffic(1000, 1000), SessionLoad(1000)
    heavy = h.chain("a heavy shared document " * 100, 1024)
    ids = ["a", "b", "c", "d"]
    for i in range(180):
        pk = heavy if i % 3 == 0 else h.chain(f"question {i} " * 60, 1024)
        traffic.count(pk, 4)
        # 40 requests each, then 20 more to "a" only.
        load.add(pk, ids[i % 4] if i < 160 else "a", traffic.g)
    return h, traffic, load, heavy.chain[0], ids


def test_a_heavy_block_moves_once_to_the_first_instance_of_its_order_under_the_mean() -> None:
    """The heavy block on overloaded "a" moves to the first of its rendezvous order that
    is at or below the mean, keeps that home when the loads change, and goes back to
    its holder when that home leaves; a light block and a block on an unloaded instance
    stay."""
    h, traffic, load, blk, ids = _state()
    seeds = [int.from_bytes(x.encode().ljust(8, b"\0"), "big") for x in ids]
    pos = {x: j for j, x in enumerate(ids)}
    moves = Moves()
    assert moves.home(traffic, load, blk, 1, [0, 1, 2, 3], ids, pos, seeds) == 1
    j = moves.home(traffic, load, blk, 0, [0, 1, 2, 3], ids, pos, seeds)
    order = sorted(range(4), key=lambda i: ((blk ^ seeds[i]) * SCORE_MULTIPLIER) & MASK64)
    # b, c and d carry 40 each, under the mean (45): the first of them in the order.
    assert j == next(i for i in reversed(order) if i != 0) and moves.moves == 1
    for _ in range(40):
        load.add(h.chain("more load " * 60, 1024), ids[j], traffic.g)
    assert moves.home(traffic, load, blk, 0, [0, 1, 2, 3], ids, pos, seeds) == j
    light = h.chain("question 5 " * 60, 1024).chain[0]
    assert moves.home(traffic, load, light, 0, [0, 1, 2, 3], ids, pos, seeds) == 0
    # Its new home leaves: back to where the index holds it ("a" is no longer 10 % over
    # the mean now that the new home took 40 more).
    moves.forget(ids[j])
    assert moves.home(traffic, load, blk, 0, [0, 1, 2, 3], ids, pos, seeds) == 0
    assert moves.moves == 1


def test_move_churn_moves_only_the_prefixes_of_the_instance_that_changed() -> None:
    """With ``stable-move``, when one of 7 instances leaves at most 1 % of the other
    prefixes move, and when one joins at most 1.1/7 of them."""
    rng = random.Random(5)
    texts = [f"doc {p} {rng.random()} " + "abcdefgh " * 150 for p in range(120)]
    stream = [rng.randrange(len(texts)) for _ in range(360)]

    def route(p: PrefixAwarePolicy, fleet: list[Instance]) -> dict[int, str]:
        home = {}
        for i, d in enumerate(stream):
            req = RouteRequest(f"r{i}", text=texts[d] + f" q{i}")
            c = p.choose(req, fleet)
            p.on_sent(req, c)
            home[d] = c.instance.id
        return home

    fleet = [Instance(f"http://127.0.0.1:{9000 + i}") for i in range(7)]
    params = PolicyParams(prefix_length=1024, placement="stable-move")
    p = PrefixAwarePolicy(params, salt=SALT)
    before = route(p, fleet)
    p.forget(fleet[-1].id)
    after = route(p, fleet[:-1])
    others = [d for d in before if before[d] != fleet[-1].id]
    assert sum(1 for d in others if after[d] != before[d]) <= 0.01 * len(others)
    q = PrefixAwarePolicy(params, salt=SALT)
    before = route(q, fleet[:-1])
    after = route(q, fleet)
    assert sum(1 for d in before if after[d] != before[d]) <= 1.1 / 7 * len(before)
