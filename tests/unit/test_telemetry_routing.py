"""The router's decision log read back by the one reader, ``telemetry.routing.read_decisions``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from preheat.errors import ConfigError
from preheat.telemetry.routing import DecisionLog, RouteDecision, read_decisions, routing_stats


def _decision(i: int, **kw: object) -> RouteDecision:
    base: dict[str, object] = {
        "ts": 1.7e9 + i,
        "request_id": f"r{i}",
        "variant": "main",
        "strategy": "prefix_aware",
        "instance": f"http://127.0.0.1:{9000 + i % 2}",
        "rank": 0,
        "outcome": "affinity",
        "matched_blocks": 2,
        "prefix_blocks": 3,
        "predicted_cached_tokens": 32,
        "actual_cached_tokens": 32,
        "prompt_tokens": 64,
        "decision_us": 5.0,
    }
    base.update(kw)
    return RouteDecision(**base)  # type: ignore[arg-type]


def test_round_trip_skips_a_torn_last_line(tmp_path: Path) -> None:
    """Every written decision reads back equal; a line cut by a killed writer is skipped."""
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, 1.0, rng=random.Random(0))
    written = [_decision(i, predicted_cached_tokens=None if i == 1 else 32) for i in range(3)]
    try:
        for d in written:
            log.write(d)
    finally:
        log.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write(written[0].to_json()[:40])  # torn: no closing brace, no newline
    assert read_decisions(path) == written


def test_a_line_that_is_not_a_decision_names_the_file_line_and_key(tmp_path: Path) -> None:
    """Valid JSON without a required key is a ConfigError naming file:line and the key."""
    path = tmp_path / "decisions.jsonl"
    path.write_text(_decision(0).to_json() + '\n{"ts": 1.0, "variant": "main"}\n')
    with pytest.raises(ConfigError, match=r"decisions\.jsonl:2: .*missing keys.*strategy"):
        read_decisions(path)


def test_older_lines_without_the_block_counts_still_read(tmp_path: Path) -> None:
    """Only ts, variant, strategy, instance, outcome and decision_us are required."""
    path = tmp_path / "decisions.jsonl"
    path.write_text(
        '{"ts": 1, "variant": "v", "strategy": "random", "instance": "http://a:1",'
        ' "outcome": "random", "decision_us": 3}\n'
    )
    (d,) = read_decisions(path)
    assert (d.request_id, d.rank, d.matched_blocks, d.predicted_cached_tokens) == ("", 0, 0, None)
    (s,) = routing_stats([d])
    assert s.shares == {"http://a:1": 1.0} and s.kv_hit_rate is None
