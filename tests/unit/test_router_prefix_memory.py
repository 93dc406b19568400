"""100,000 distinct prefixes keep the prefix_aware router's memory bounded (pure policy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.router.policies import Instance, PolicyParams, RouteRequest, make_policy


@pytest.mark.parametrize("placement", ["stable", "learned", "hybrid"])
def test_100k_distinct_prefixes_keep_the_policy_memory_bounded(placement: str) -> None:
    """With index_entries 1,000 the learned index never holds more than 1,000 blocks, and
    this process's RSS after 100,000 prefixes is within 4 MB of its RSS after 20,000."""
    params = PolicyParams(index_entries=1000, prefix_length=1024, placement=placement)
    policy = make_policy("prefix_aware", params, salt=b"0123456789abcdef", rng=None)
    instances = [Instance(f"http://127.0.0.1:{9000 + i}") for i in range(4)]

    def route(start: int, n: int) -> None:
        for i in range(start, start + n):
            req = RouteRequest(request_id=str(i), text=f"{i:08d} distinct document " * 40)
            choice = policy.choose(req, instances)
            policy.on_sent(req, choice)
            policy.on_done(req, choice, ok=True, cached_tokens=None)

    route(0, 20_000)
    after_20k = _rss_kb()
    route(20_000, 80_000)
    after_100k = _rss_kb()
    assert len(policy.index) <= 1000  # type: ignore[attr-defined]
    # 80,000 more remembered prefixes would be well over 10 MB (~200 bytes per block).
    assert after_100k - after_20k < 4 * 1024, (after_20k, after_100k)


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")
