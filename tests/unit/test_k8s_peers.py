"""The pure parts of peers in Kubernetes mode: origin slot choice, the NodeCache peer view
and status, the peer settings ConfigMap, and the rendered agent's peer wiring."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.control.fanout import Budget, Slot, origin_slot_names, pick_slot, slot_holders
from preheat.errors import ConfigError
from preheat.runtime.kubernetes.agent_peers_config import parse_settings, read_token
from preheat.runtime.kubernetes.nodecache_peers import (
    MAX_BLOBS,
    MAX_WARMUPS,
    peer_status,
    peers_from_nodecaches,
)
from preheat.runtime.kubernetes.render import PEER_TOKEN_SECRET, system_manifests
from preheat.telemetry.records import WarmupRecord


def test_slot_names_are_per_revision_without_a_budget_and_cluster_wide_with_one() -> None:
    """No budget: one slot named after the revision; concurrentFills N: N shared slots."""
    assert origin_slot_names(Budget(), "sha256:ABCDEF0123456789ff") == (
        "preheat-origin-abcdef012345",
    )
    assert origin_slot_names(Budget(concurrent_fills=2), "x") == (
        "preheat-origin-0",
        "preheat-origin-1",
    )


def test_pick_slot_prefers_its_own_then_free_then_expired_never_a_live_one() -> None:
    """A holder renews its own slot; others take the first free slot by name, or one whose
    holder stopped renewing; with every slot live there is nothing to claim."""
    live = Slot("s0", "a/r", renewed=100.0, duration=15)
    mine = Slot("s1", "b/r", renewed=100.0, duration=15)
    free = Slot("s2")
    assert pick_slot([free, mine, live], "b/r", now=101) == mine
    assert pick_slot([free, live], "c/r", now=101) == free
    assert pick_slot([live], "c/r", now=114.9) is None
    assert pick_slot([live], "c/r", now=115.0) == live  # expired: taken over
    assert slot_holders([live, mine, free], now=101) == {("a", "r"), ("b", "r")}
    assert slot_holders([live], now=200) == set()


def test_peers_from_nodecaches_skips_itself_and_nodes_without_a_url() -> None:
    """Other nodes with a peer URL are peers, with their listed blobs and whether they fill."""
    objs = [
        {"metadata": {"name": "a"}, "status": {"peer": {"url": "http://10.0.0.1:9102/",
                                                        "blobs": ["d1", "d2"]}}},
        {"metadata": {"name": "b"}, "status": {"peer": {"url": "http://b"},
                                               "revisions": [{"state": "Filling"}]}},
        {"metadata": {"name": "me"}, "status": {"peer": {"url": "http://me"}}},
        {"metadata": {"name": "old"}, "status": {}},
    ]  # fmt: skip
    peers = peers_from_nodecaches(objs, "me")
    assert sorted(peers) == ["a", "b"]
    assert peers["a"].url == "http://10.0.0.1:9102" and peers["a"].blobs == {"d1", "d2"}
    assert not peers["a"].filling and peers["b"].filling and not peers["b"].blobs


def test_peer_status_is_bounded_and_stable() -> None:
    """Blobs sorted and capped, only the newest warm-ups, every bytesFrom key present."""
    recs = [WarmupRecord("n", f"r{i}", 1.23456, "peer", {"peer": 5}) for i in range(20)]
    out = peer_status("http://n", [f"{i:064x}" for i in range(MAX_BLOBS + 10)], recs)
    assert len(out["peer"]["blobs"]) == MAX_BLOBS and out["peer"]["blobs"] == sorted(
        out["peer"]["blobs"]
    )
    assert [w["revision"] for w in out["warmups"]] == [f"r{i}" for i in range(20 - MAX_WARMUPS, 20)]
    assert out["warmups"][0] == {
        "revision": "r12", "mode": "peer", "seconds": 1.235,
        "bytesFrom": {"origin": 0, "peer": 5, "cache": 0},
    }  # fmt: skip
    assert peer_status("http://n", ["b", "a"], recs) == peer_status("http://n", ["a", "b"], recs)


def test_settings_parse_like_the_cluster_file_and_name_bad_values() -> None:
    """The ConfigMap's settings.yaml takes the cluster file's origin / peers keys."""
    s = parse_settings(
        "origin:\n  bandwidth: 8MB/s\n  budget: {concurrentFills: 2, bandwidth: 1MiB/s}\n"
    )
    assert s.budget == Budget(2, 1 << 20) and s.node_bandwidth == 8_000_000 and s.enabled
    assert (
        parse_settings(None).budget == Budget()
        and not parse_settings("peers: {enabled: false}").enabled
    )
    with pytest.raises(ConfigError, match="concurrentFills 0 must be at least 1"):
        parse_settings("origin: {budget: {concurrentFills: 0}}")
    with pytest.raises(ConfigError, match=r"unknown key.*nodes"):
        parse_settings("nodes: []")


def test_token_file_is_required_long_enough_and_never_echoed(tmp_path: Path) -> None:
    """A missing or short token file is a ConfigError that names the file, not the token."""
    with pytest.raises(ConfigError, match="preheat-peer-token Secret"):
        read_token(tmp_path / "absent")
    (tmp_path / "t").write_text("short-secret\n")
    with pytest.raises(ConfigError, match="shorter than 16") as err:
        read_token(tmp_path / "t")
    assert "short-secret" not in str(err.value)
    (tmp_path / "t").write_text("s" * 40 + "\n")
    assert read_token(tmp_path / "t") == "s" * 40


def test_rendered_agent_serves_peers_with_the_token_from_a_secret() -> None:
    """The DaemonSet opens the peer port, advertises $(POD_IP) and mounts the Secret."""
    (ds,) = [m for m in system_manifests() if m["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert {"name": "peers", "containerPort": 9102} in c["ports"]
    args = " ".join(c["args"])
    assert "--peer-port 9102" in args and "--peer-url http://$(POD_IP):9102" in args
    assert "--peer-token-file /etc/preheat/peer/token" in args
    assert {
        "name": "peer-token",
        "secret": {"secretName": PEER_TOKEN_SECRET, "defaultMode": 0o400},
    } in pod["volumes"]
    assert any(e["name"] == "POD_IP" for e in c["env"])
    (cm,) = [m for m in system_manifests() if m["kind"] == "ConfigMap"]
    assert parse_settings(cm["data"]["settings.yaml"]).budget == Budget()


def test_origin_pieces_are_served_as_they_land_and_lists_merge() -> None:
    """A landed origin piece is held under its digest ("" for the rest); a longer list
    from a seed keeps what is held, a conflicting one starts over."""
    from preheat.sources.pieces import PieceBook

    book = PieceBook()
    book.landed("d", 40, 16, 2, "c" * 64)
    entry = book.get("d")
    assert entry is not None and entry.digests == ("", "", "c" * 64) and entry.verified == {2}
    assert entry.covers(32, 40) and not entry.covers(0, 16)
    book.landed("d", 40, 16, 2, "f" * 64)  # other bytes for a held piece: ignored
    assert entry.digests[2] == "c" * 64
    merged = book.start("d", 40, 16, ("a" * 64, "", "c" * 64))
    assert merged is entry and entry.digests == ("a" * 64, "", "c" * 64) and entry.verified == {2}
    fresh = book.start("d", 40, 16, ("a" * 64, "b" * 64, "e" * 64))
    assert fresh is not entry and fresh.verified == set()
