"""Cold-start simulator: image pulls, crash restarts in place, request queueing, pinned runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from preheat.errors import ConfigError
from preheat.sim.coldstart import simulate
from preheat.sim.coldstart_catalog import catalog_from_dict
from preheat.sim.coldstart_files import prepare
from preheat.sim.coldstart_queue import ModelQueue, summarize_queues
from preheat.sim.coldstart_result import ColdStartResult
from preheat.telemetry.records import EventClass

# Startup costs of every scenario here: runtime 20 s, 10 GB at 4 GB/s, warm-up 30 s.
AFTER_WEIGHTS = 20 + 10 / 4 + 30


def _catalog(*, image: bool = True, models: int = 2, **top: Any) -> dict[str, Any]:
    ms: list[dict[str, Any]] = [
        {"name": n, "size": "10GB", "popularity": 1, "max_replicas": 1, "min_replicas": 0}
        for n in "ab"[:models]
    ]
    if image:
        for m in ms:
            m.update(image="img", image_size="5GB")
    out: dict[str, Any] = {
        "models": ms,
        "autoscaling": {"target_in_flight": 8, "scale_in_below": 1, "cooldown_seconds": 60},
        "traffic": {"replica_mtbf_seconds": 0},
    }
    for key, value in top.items():
        out[key] = {**out.get(key, {}), **value}
    return out


def _trace(tmp_path: Path, lines: list[dict[str, Any]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# Model a is served first, then b on the same (only) node.
A_THEN_B = [
    {"t": 0, "model": "a", "in_flight": 8},
    {"t": 2000, "model": "a", "in_flight": 0},
    {"t": 2000, "model": "b", "in_flight": 8},
]


def _run(
    tmp_path: Path, catalog: dict[str, Any], lines: list[dict[str, Any]], **kw: Any
) -> ColdStartResult:
    args: dict[str, Any] = {
        "nodes": 1,
        "nvme": "100GB",
        "policy": "lru",
        "trace": _trace(tmp_path, lines),
        "origin_bandwidth": "2GB/s",
        "registry_bandwidth": "1GB/s",
        "duration": "1h",
        "seed": 1,
    }
    args.update(kw)
    setup, rng = prepare(models=catalog_from_dict(catalog), **args)
    return simulate(setup, rng)


def test_a_node_that_holds_the_image_is_ready_sooner_by_its_pull(tmp_path: Path) -> None:
    """a pulls the shared image (5 GB at 1 GB/s) before its weights; b on the same node
    finds it cached and is ready exactly 5 s sooner; without images both take as long as b."""
    before = _catalog(startup={"image_pull": "before"})
    res = _run(tmp_path, before, A_THEN_B)
    a, b = res.world.records
    assert (a.variant, a.image_source, b.variant, b.image_source) == ("a", "pull", "b", "cache")
    assert a.ready_seconds == pytest.approx(5 + 10 / 2 + AFTER_WEIGHTS)
    assert a.ready_seconds - b.ready_seconds == pytest.approx(5e9 / 1e9)  # image / registry
    assert res.summary["registry_bytes"] == 5_000_000_000 and res.summary["image_pulls"] == 1
    assert res.summary["classes"]["new_node"]["image_pulls"] == 1
    plain = _run(tmp_path, _catalog(image=False), A_THEN_B).world.records
    assert [r.ready_seconds for r in plain] == pytest.approx([b.ready_seconds] * 2)
    assert plain[0].image_source is None


def test_a_concurrent_image_pull_overlaps_the_weights_and_shares_the_node_link(
    tmp_path: Path,
) -> None:
    """Pulled with the weights, the image costs only the node link it shares: the weights
    get half of 25 Gbps for the 5 s of the pull, then the origin's 2 GB/s."""
    res = _run(tmp_path, _catalog(), A_THEN_B)
    a = res.world.records[0]
    share = 25e9 / 8 / 2
    weights = 5 + (10e9 - 5 * share) / 2e9
    assert a.ready_seconds == pytest.approx(weights + AFTER_WEIGHTS)
    assert a.image_ready == pytest.approx(a.scheduled + 5)  # recorded stage by stage


def test_a_crash_on_a_warm_node_is_a_warm_restart_with_its_own_readiness(tmp_path: Path) -> None:
    """A ready replica that crashes is restarted in place and classed warm_restart: backoff
    0.2 s + restart 10 s + 10 GB from the page cache at 20 GB/s + warm-up 30 s."""
    cat = _catalog(models=1, traffic={"replica_mtbf_seconds": 900})
    res = _run(tmp_path, cat, [{"t": 0, "model": "a", "in_flight": 8}], duration="3h")
    out = res.summary
    warm = [r for r in res.world.records if r.event_class is EventClass.WARM_RESTART]
    assert out["restarts"] >= 3 and len(warm) >= 3
    assert out["readiness"]["warm_restart"]["p50_s"] < out["readiness"]["new_node"]["p50_s"]
    first = warm[0]
    assert first.restart_count == 1 and first.replica == res.world.records[0].replica
    assert first.ready_seconds == pytest.approx(0.2 + 10 + 10 / 20 + 30)
    assert (first.weights_source, first.image_source) == ("cache", "cache")
    assert out["classes"]["warm_restart"]["misses"] == 0
    assert out["starts"] == 1 + len(warm)  # no second replica was started for it


def test_requests_queue_while_capacity_is_short_and_the_bound_drops_the_rest(
    tmp_path: Path,
) -> None:
    """32 in flight over 10 s requests is 3.2 arrivals/s; nothing serves until the replica
    is up, then 1.6/s: the queue fills to its bound of 10 and everything beyond is dropped."""
    cat = _catalog(image=False, models=1, queue={"request_seconds": 10, "replica_in_flight": 16})
    lines = [{"t": 0, "model": "a", "in_flight": 32}]
    res = _run(tmp_path, cat, lines, queue_bound=10)
    ready_at = res.world.records[0].first_response
    assert ready_at is not None
    q = res.summary["queue"]
    assert q["requests"] == round(3.2 * 3600)
    served = 1.6 * (3600 - ready_at)
    assert q["queued_at_end"] == 10
    assert q["dropped"] == round(3.2 * 3600 - served - 10)
    assert q["wait_p50_s"] == pytest.approx(10 / 1.6, abs=1e-3)  # a full queue ahead
    # The longest wait: the 10th request, queued at 10 / 3.2 s, served 10 / 1.6 s after
    # the replica is up (within the 1/16 of a piece the points resolve).
    assert q["wait_max_s"] == pytest.approx(ready_at + 10 / 1.6 - 10 / 3.2, rel=1e-2)
    assert res.summary["dropped_requests"] == q["dropped"]
    assert res.summary["unmet_demand_s"] > 3000
    # No queue: whatever the replicas cannot take at once is dropped, and nobody waits.
    none = _run(tmp_path, cat, lines, queue_bound=0).summary["queue"]
    assert none["dropped"] == round(3.2 * 3600 - served) and none["wait_p99_s"] == 0


def test_a_queue_drains_at_the_spare_capacity_first_in_first_out() -> None:
    """Two requests/s for 10 s with no capacity, then 4/s of capacity: the backlog of 20
    drains at 2/s in 10 s; the first request waited longest (20 s), the last none."""
    q = ModelQueue(max_queued=100)
    q.set_rates(2.0, 0.0)
    q.advance(0.0, 10.0)
    assert q.queued == pytest.approx(20)
    q.set_rates(2.0, 4.0)
    q.advance(10.0, 30.0)
    s = summarize_queues({"m": q})
    assert q.queued == 0 and s.requests == pytest.approx(60) and s.dropped == 0
    assert s.waited == pytest.approx(40)  # the 20 of the backlog and the 20 behind them
    assert s.wait_max_s == pytest.approx(10.0, rel=0.05)
    assert s.wait_p50_s == pytest.approx(0.0, abs=1e-9) or s.wait_p50_s < 10


def test_image_fields_are_validated() -> None:
    """An image without a size, or one image with two sizes, is refused with the fix."""
    with pytest.raises(ConfigError, match="image and image_size together"):
        catalog_from_dict({"models": [{"name": "x", "size": "1GB", "popularity": 1, "image": "i"}]})
    two = [
        {"name": "x", "size": "1GB", "popularity": 1, "image": "i", "image_size": "1GB"},
        {"name": "y", "size": "1GB", "popularity": 1, "image": "i", "image_size": "2GB"},
    ]
    with pytest.raises(ConfigError, match="one image_size"):
        catalog_from_dict({"models": two})
    with pytest.raises(ConfigError, match="image_pull"):
        catalog_from_dict({**_catalog(), "startup": {"image_pull": "later"}})


# A small fleet with every effect on: images, crashes, a queue, spot churn.
PINNED = {
    "zipf": 1.0,
    "models": [
        {"name": "big", "size": "300GB", "image": "vllm", "image_size": "9GB"},
        {"name": "mid", "size": "120GB", "image": "vllm", "image_size": "9GB"},
        {"name": "small", "size": "40GB", "image": "sglang", "image_size": "12GB"},
    ],
    "autoscaling": {"target_in_flight": 16, "scale_in_below": 8, "cooldown_seconds": 120},
    "traffic": {"replica_mtbf_seconds": "1d"},
}


def test_a_seeded_run_gives_byte_identical_json() -> None:
    """The same seed prints the same bytes every time; the digest pins this run's figures."""

    def once() -> str:
        setup, rng = prepare(
            nodes=6, nvme="1TB", models=catalog_from_dict(PINNED), policy="lru",
            pattern="spot", origin_bandwidth="20Gbps", duration="12h", seed=5,
        )  # fmt: skip
        return json.dumps(simulate(setup, rng).to_dict(), sort_keys=True)

    text = once()
    assert once() == text
    out = json.loads(text)
    assert out["restarts"] > 0 and out["image_pulls"] > 0 and out["queue"]["requests"] > 0
    assert hashlib.sha256(text.encode()).hexdigest() == PINNED_SHA256


PINNED_SHA256 = "4063ee3a1149ad02c96424883788415061be89a4eb9a46ff34cb067f4a004f6b"


def test_every_model_gets_its_first_replica_at_once_when_its_count_never_changes(
    tmp_path: Path,
) -> None:
    """Models whose demand keeps them at min_replicas were never planned until some other
    replica stopped (the first plan ran only for models whose count changed): each of the
    four starts at t = 0 now."""
    four = {
        "models": [{"name": n, "size": "10GB", "popularity": 1} for n in "abcd"],
        "traffic": {"replica_mtbf_seconds": 0},
    }
    lines = [{"t": 0, "total": 8}]  # 2 in flight each: one replica, the minimum
    res = _run(tmp_path, four, lines, nodes=4, duration="30m", origin_bandwidth="10GB/s")
    assert sorted((r.variant, r.scheduled) for r in res.world.records) == [(n, 0.0) for n in "abcd"]
    assert res.summary["queue"]["dropped"] == 0
