"""The cluster file's fan-out keys (origin.budget, peers) and the WarmupRecord value."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.control.fanout import Budget
from preheat.control.spec import parse_cluster
from preheat.errors import ConfigError
from preheat.telemetry.records import WarmupRecord

NODES = [{"name": "a"}]


def test_defaults_are_peers_on_and_one_fill_per_revision(tmp_path: Path) -> None:
    """Without the keys, peers are on and the budget is one origin fill per revision."""
    c = parse_cluster({"nodes": NODES}, base_dir=tmp_path)
    assert c.peers.enabled is True
    assert c.origin.budget == Budget(concurrent_fills=None, bandwidth=None)


def test_budget_and_peers_keys_parse(tmp_path: Path) -> None:
    """``origin.budget.concurrentFills``/``bandwidth`` and ``peers.enabled`` are read."""
    c = parse_cluster(
        {
            "origin": {"budget": {"concurrentFills": 2, "bandwidth": "100MiB/s"}},
            "peers": {"enabled": False},
            "nodes": NODES,
        },
        base_dir=tmp_path,
    )
    assert c.origin.budget == Budget(concurrent_fills=2, bandwidth=100 << 20)
    assert c.peers.enabled is False


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"origin": {"budget": {"concurrentFills": 0}}}, "origin.budget.concurrentFills 0"),
        ({"origin": {"budget": {"bandwidth": "0MB/s"}}}, "origin.budget.bandwidth"),
        ({"peers": {"enabled": True, "port": 3}}, "port"),
    ],
)
def test_bad_keys_name_the_field(tmp_path: Path, doc: dict, needle: str) -> None:  # type: ignore[type-arg]
    """A bad budget or an unknown peers key is a ConfigError that names the field."""
    with pytest.raises(ConfigError, match=needle):
        parse_cluster({**doc, "nodes": NODES}, base_dir=tmp_path)


def test_warmup_record_checks_its_fields() -> None:
    """A warm-up record takes cache/peer/origin sources and bytes >= 0, nothing else."""
    rec = WarmupRecord("a", "sha256:x", 1.5, "peer", {"peer": 10, "cache": 2})
    assert rec.to_dict() == {
        "node": "a",
        "revision": "sha256:x",
        "seconds": 1.5,
        "mode": "peer",
        "bytes_from": {"peer": 10, "cache": 2},
    }
    with pytest.raises(ValueError, match="bytes_from has source 'disk'"):
        WarmupRecord("a", "r", 1.0, "peer", {"disk": 1})
    with pytest.raises(ValueError, match="mode"):
        WarmupRecord("a", "r", 1.0, "seed")
    with pytest.raises(ValueError, match="seconds"):
        WarmupRecord("a", "r", -1.0, "origin")
