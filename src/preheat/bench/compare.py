"""How router benchmarks compare: like with like, and added latency per request.

Two rules every router benchmark follows:

* **Like with like.** A preheat strategy is compared only with the peer policy that does
  the same job: ``random`` with the peers' ``random``, ``prefix_aware`` with their
  ``cache_aware``. ``counterparts`` names the pairs; a row without a counterpart (for
  example ``least_outstanding``) is shown but never put in a ratio.
* **Added latency is paired.** Each request of one stream is sent directly and through
  the router; the added latency at a percentile is that percentile of the per-request
  differences (router - direct), so p99 >= p50 by construction. ``paired_added`` computes
  it; a difference of percentiles (router p99 - direct p99) is a different, smaller
  figure when the two tails do not line up, and is labelled as such wherever shown.

Percentiles come from ``preheat.telemetry.stats.percentile`` (interpolated), the one
percentile function of the project.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from preheat.telemetry.stats import percentile

__all__ = [
    "PEER_POLICY",
    "AddedLatency",
    "counterparts",
    "paired_added",
    "policy_class",
]

#: preheat strategy -> the peer routers' policy that does the same job.
PEER_POLICY: dict[str, str] = {"random": "random", "prefix_aware": "cache_aware"}


def policy_class(name: str) -> str | None:
    """The comparison class of a router label (``preheat-random``, ``sglang-cache_aware``,
    ``prefix_aware-hash``...): ``random``, ``cache_aware``, or None (no counterpart)."""
    kind, _, rest = name.partition("-")
    # "router-policy[-placement]", or a bare preheat strategy ("prefix_aware-hash",
    # "prefix_aware:1.0:0.1").
    policy = rest.partition("-")[0] if kind in ("preheat", "sglang", "vllm") else kind
    policy = policy.partition(":")[0]
    if policy in PEER_POLICY:
        return PEER_POLICY[policy]
    return policy if policy in PEER_POLICY.values() else None


def counterparts(names: Iterable[str], ours: Iterable[str]) -> list[tuple[str, str]]:
    """(ours, peer) pairs of the same class, in order; never across classes."""
    names = list(names)
    mine = [n for n in ours if n in names]
    peers = [n for n in names if n not in mine]
    return [
        (a, b)
        for a in mine
        for b in peers
        if policy_class(a) is not None and policy_class(a) == policy_class(b)
    ]


@dataclass(frozen=True, slots=True)
class AddedLatency:
    """Latency a router adds, from paired measurements of one request stream (seconds)."""

    n: int
    direct_p50: float
    direct_p99: float
    routed_p50: float
    routed_p99: float
    added_p50: float
    """p50 of the per-request differences (routed - direct)."""
    added_p99: float
    """p99 of the per-request differences (>= added_p50 by construction)."""

    @property
    def p99_gap(self) -> float:
        """routed p99 - direct p99: a difference of percentiles, not an added latency."""
        return self.routed_p99 - self.direct_p99


def paired_added(direct: Sequence[float], routed: Sequence[float]) -> AddedLatency:
    """Added latency from ``direct[i]`` and ``routed[i]``, the same request i sent both ways."""
    if len(direct) != len(routed):
        raise ValueError(
            f"paired latencies need one direct and one routed time per request; got "
            f"{len(direct)} direct and {len(routed)} routed"
        )
    if not direct:
        raise ValueError("no paired requests: every request failed on one path or the other")
    diffs = [r - d for d, r in zip(direct, routed, strict=True)]
    return AddedLatency(
        n=len(diffs),
        direct_p50=percentile(direct, 50),
        direct_p99=percentile(direct, 99),
        routed_p50=percentile(routed, 50),
        routed_p99=percentile(routed, 99),
        added_p50=percentile(diffs, 50),
        added_p99=percentile(diffs, 99),
    )
