"""Router benchmarks compare like with like, and added latency is paired per request."""

from __future__ import annotations

import random

import pytest

from preheat.bench.compare import counterparts, paired_added, policy_class
from preheat.telemetry.stats import percentile
from preheat.testing.routers import PEER_ROUTERS, peer_router_argv


def test_random_is_never_compared_with_cache_aware() -> None:
    """preheat random pairs with the peers' random, prefix_aware with their cache_aware."""
    names = [
        "preheat-random",
        "preheat-prefix_aware",
        "sglang-cache_aware",
        "vllm-cache_aware",
        "sglang-random",
    ]
    pairs = counterparts(names, ["preheat-random", "preheat-prefix_aware"])
    assert pairs == [
        ("preheat-random", "sglang-random"),
        ("preheat-prefix_aware", "sglang-cache_aware"),
        ("preheat-prefix_aware", "vllm-cache_aware"),
    ]
    assert counterparts(["preheat-random", "sglang-cache_aware"], ["preheat-random"]) == []


@pytest.mark.parametrize(
    ("label", "cls"),
    [
        ("random", "random"),
        ("prefix_aware", "cache_aware"),
        ("prefix_aware-hybrid", "cache_aware"),
        ("prefix_aware:1.0:0.1", "cache_aware"),
        ("preheat-prefix_aware", "cache_aware"),
        ("vllm-random", "random"),
        ("least_outstanding", None),
        ("sglang-power_of_two", None),
    ],
)
def test_policy_class_of_every_benchmark_label(label: str, cls: str | None) -> None:
    """Every label the router benchmarks use maps to its comparison class."""
    assert policy_class(label) == cls


def test_added_p99_is_a_percentile_of_per_request_differences() -> None:
    """On a stream whose direct tail is noisier than the routed one, the difference of
    percentiles puts p99 below p50; the paired figure never does."""
    rng = random.Random(3)
    direct = [0.001 + (0.004 if rng.random() < 0.03 else 0.0) for _ in range(2000)]
    routed = [d + 0.0002 + rng.uniform(0, 0.0001) for d in direct]
    routed = [min(r, 0.0022) for r in routed]  # a router whose own tail is capped
    a = paired_added(direct, routed)
    old_style_p50 = percentile(routed, 50) - percentile(direct, 50)
    assert a.p99_gap < old_style_p50  # what the old table printed
    assert a.added_p99 >= a.added_p50
    diffs = [r - d for d, r in zip(direct, routed, strict=True)]
    assert a.added_p50 == pytest.approx(percentile(diffs, 50))
    assert a.n == 2000


def test_paired_added_refuses_unpaired_samples() -> None:
    """Samples of different lengths are not pairs; the message gives both counts."""
    with pytest.raises(ValueError, match="3 direct and 2 routed"):
        paired_added([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="no paired requests"):
        paired_added([], [])


@pytest.mark.parametrize("kind", sorted(PEER_ROUTERS))
def test_peer_routers_run_with_their_default_retries(kind: str) -> None:
    """A peer router's command line keeps its retries and circuit breaker as shipped."""
    argv = peer_router_argv(
        kind, 8000, ["http://127.0.0.1:9"], policy="random", prometheus_port=9000
    )
    assert not any(a.startswith(("--disable-retries", "--disable-circuit")) for a in argv)
    assert not any(a.startswith(("--retry-", "--cb-")) for a in argv)
    assert argv[argv.index("--policy") + 1] == "random"
    with pytest.raises(ValueError, match="'nginx' is unknown"):
        peer_router_argv("nginx", 1, [], policy="random", prometheus_port=2)
