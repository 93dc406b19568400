"""The ``stable`` placement's lazily weighted fresh pick is the pick of every weight."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.router.kvindex import CapacityIndex
from preheat.router.policies.stable import StablePlacement
from preheat.router.policies.stable_weights import FleetWeights
from preheat.router.prefix import PrefixKey

SEEDS = [random.Random(7).getrandbits(64) for _ in range(128)]


def _pick(pk: PrefixKey, w: object, n: int) -> int:
    """The fresh placement of ``pk`` over ``n`` instances, no block hot or held."""
    sp = StablePlacement(CapacityIndex(10_000, 4), 10_000, 1000)
    ids = [f"i{j}" for j in range(n)]
    pick, outcome, _, _ = sp.choose(pk, ids, [0] * n, SEEDS[:n], lambda only: w, threshold=64)
    assert outcome == "fallback"
    return pick


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 128),
    key=st.integers(0, (1 << 64) - 1),
    gain=st.sampled_from([0.0, 0.01, 0.5, 2.0, 20.0]),
    ties=st.booleans(),
    caps=st.booleans(),
    seed=st.integers(0, 1 << 30),
)
def test_lazy_fleet_weights_pick_what_the_full_list_picks(
    n: int, key: int, gain: float, ties: bool, caps: bool, seed: int
) -> None:
    """Skipping instances whose score bound cannot win never changes the pick or a weight."""
    rng = random.Random(seed)
    loads = [float(rng.randrange(3)) if ties else rng.uniform(0, 50) for _ in range(n)]
    cap = [rng.choice([0.5, 1.0]) for _ in range(n)] if caps else None
    mean = sum(loads) / n
    # The gain over the mean as stable_weights.py scales it (at most 20).
    lazy = FleetWeights(cap, loads, mean, gain / max(mean, 1.0))
    full = list(FleetWeights(cap, loads, mean, gain / max(mean, 1.0)))
    assert [lazy[j] for j in range(n)] == full
    assert all(w <= lazy.bound() for w in full)
    pk = PrefixKey((key,), 100, 100, cuts=(100,))
    assert _pick(pk, lazy, n) == _pick(pk, full, n)


def test_equal_weights_fall_to_the_plain_score_order() -> None:
    """With every weight equal the lazy pick is the highest plain score, first on ties."""
    n = 64
    pk = PrefixKey((12345,), 100, 100, cuts=(100,))
    lazy = FleetWeights(None, [5.0] * n, 5.0, 0.4)
    assert _pick(pk, lazy, n) == _pick(pk, None, n) == _pick(pk, list(lazy), n)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 64),
    key=st.integers(0, (1 << 64) - 1),
    gain=st.sampled_from([0.0, 0.5, 20.0]),
    seed=st.integers(0, 1 << 30),
)
def test_lazy_pick_in_a_hot_set_keeps_the_members_order_on_ties(
    n: int, key: int, gain: float, seed: int
) -> None:
    """Of a narrowed set in any order, the lazy pick is the full list's (first of equals)."""
    rng = random.Random(seed)
    members = rng.sample(range(128), n)
    loads = [float(rng.randrange(2)) for _ in range(n)]
    mean = sum(loads) / n + rng.uniform(0, 1)
    lazy = FleetWeights(None, loads, mean, gain / max(mean, 1.0))
    got = StablePlacement._best(key, SEEDS, members, lazy)
    assert got == StablePlacement._best(key, SEEDS, members, list(lazy))
    # Equal weights: the plain rendezvous order decides, the first member on a tie.
    same = FleetWeights(None, [1.0] * n, 1.0, 0.5)
    assert StablePlacement._best(key, SEEDS, members, same) == StablePlacement._best(
        key, SEEDS, members, None
    )
