"""The seed side of Kubernetes peers, from plain data: fill progress as a NodeCache
publishes it (bounded, round-tripping) and the directory a receiving agent's fill asks
(holders first, filling peers for the pieces they list, seeds and their progress)."""

from __future__ import annotations

from typing import Any

from preheat.control.fanout import Budget, Mode, WarmRequest, plan_fanout
from preheat.runtime.kubernetes.nodecache_peers import (
    MAX_FILLING,
    MAX_RANGES,
    FillProgress,
    NodeCacheView,
    parse_ranges,
    peer_status,
    peers_from_nodecaches,
    piece_ranges,
)


def test_piece_ranges_round_trip_and_stay_bounded() -> None:
    """Indices become "0-2,5" and back; past MAX_RANGES ranges the rest is left out
    (never invented), and a bad value reads as nothing verified."""
    assert piece_ranges({5, 0, 1, 2}) == "0-2,5" and piece_ranges(()) == ""
    assert parse_ranges("0-2,5", 10) == {0, 1, 2, 5}
    assert parse_ranges("0-99", 4) == {0, 1, 2, 3}
    every_other = set(range(0, 4 * MAX_RANGES, 2))
    text = piece_ranges(every_other)
    assert text.count(",") == MAX_RANGES - 1
    assert parse_ranges(text, 1000) == set(range(0, 2 * MAX_RANGES, 2))
    for bad in ("x", "1-", "-3", 7, None, "1-2;3"):
        assert parse_ranges(bad, 10) == frozenset(), bad


def test_peer_status_publishes_fill_progress_bounded_and_idle_as_empty() -> None:
    """status.peer.filling lists each blob in progress (pieces, landed, verified ranges),
    at most MAX_FILLING of them, sorted; no pieces yet means no verified key; idle is []."""
    many = {f"{i:064x}": FillProgress(4, 1, frozenset({3})) for i in range(MAX_FILLING + 5)}
    out = peer_status("http://n", [], [], many)["peer"]["filling"]
    assert len(out) == MAX_FILLING and [e["blob"] for e in out] == sorted(e["blob"] for e in out)
    assert out[0] == {"blob": f"{0:064x}", "pieces": 4, "landed": 1, "verified": "3"}
    fresh = peer_status("http://n", [], [], {"d": FillProgress(2, 0)})["peer"]["filling"]
    assert fresh == [{"blob": "d", "pieces": 2, "landed": 0}]
    assert peer_status("http://n", [], [])["peer"]["filling"] == []


def _objs() -> list[dict[str, object]]:
    seed = {"url": "http://seed", "blobs": ["small"],
            "filling": [{"blob": "big", "pieces": 3, "landed": 2, "verified": "0,2"},
                        {"blob": "junk", "pieces": "x", "landed": 1}]}  # fmt: skip
    return [
        {"metadata": {"name": "seed"}, "status": {"peer": seed,
                                                  "revisions": [{"state": "Filling"}]}},
        {"metadata": {"name": "holder"}, "status": {"peer": {"url": "http://h", "blobs": ["big"]}}},
        {"metadata": {"name": "other"}, "status": {"peer": {"url": "http://o"},
                                                   "revisions": [{"state": "Filling"}]}},
    ]  # fmt: skip


def test_receivers_ask_holders_first_and_a_filling_peer_only_for_its_verified_pieces() -> None:
    """Piece 0 of "big": the complete holder, then the seed (it lists 0 verified); piece 1:
    the holder only; a filling peer that lists no progress is never asked (it would 404
    and the fill would give up on it for the blob); avoided peers drop out."""
    view = NodeCacheView()
    view.peers = peers_from_nodecaches(_objs(), "me")
    assert set(view.peers["seed"].progress) == {"big"}
    assert view.peers["seed"].progress["big"] == FillProgress(3, 2, frozenset({0, 2}))
    assert [n for n, _ in view.candidates("big", 0, "me")] == ["holder", "seed"]
    assert [n for n, _ in view.candidates("big", 1, "me")] == ["holder"]
    assert view.candidates("other-blob", 0, "me") == []
    said: list[str] = []
    view.on_avoid = lambda peer, why: said.append(peer)
    view.avoid("holder", "bad bytes")
    view.avoid("holder", "again")
    assert [n for n, _ in view.candidates("big", 0, "me")] == ["seed"] and said == ["holder"]


def test_seeds_count_as_sources_and_their_progress_is_what_they_published() -> None:
    """A node with an origin slot for the revision is a seed of the blobs it lacks: the
    fan-out gives the receiver ``peer`` while nothing is complete; seed_progress reports
    its landed pieces (0 before it publishes any), not for blobs it holds complete, not
    to itself, and not once avoided."""
    view = NodeCacheView()
    view.peers = peers_from_nodecaches(_objs(), "me")
    view.seeds = {"seed": frozenset({"big", "new"})}
    req = WarmRequest("me", "r", frozenset({"big", "new"}))
    alone = plan_fanout([req], {}, {("seed", "r")}, Budget(concurrent_fills=1))
    assert alone[("me", "r")] is Mode.WAIT  # the budget is spent and no seed is known
    plan = plan_fanout(
        [req], view.complete(req.missing), {("seed", "r")}, Budget(1), view.filling("me")
    )
    assert plan[("me", "r")] is Mode.PEER
    assert view.seed_progress("big", "me") == {"seed": 2}
    assert view.seed_progress("new", "me") == {"seed": 0}
    assert view.seed_progress("big", "seed") == {}
    view.seeds = {"seed": frozenset({"small"})}
    assert view.seed_progress("small", "me") == {}  # published: a complete holder
    view.seeds = {"seed": frozenset({"big"})}
    view.avoid("seed", "bad bytes")
    assert view.seed_progress("big", "me") == {} and view.filling("me") == {}


def test_invalid_peer_settings_make_the_nodecache_degraded_before_a_failed_warm_up() -> None:
    """nodecache_status's ``degraded`` (the agent's invalid peer settings) sets
    Degraded=True with its reason and message, names a failed warm-up too, and the
    condition keeps its transition time while it holds; without it, the old reasons."""
    from preheat.runtime.kubernetes.nodecache_status import WantedRevision, nodecache_status

    def degraded(**kw: object) -> dict[str, Any]:
        base: dict[str, object] = dict(
            generation=1, now="2026-12-01T12:00:00Z", capacity_bytes=None, free_bytes=1,
            held=[], pending=[], wanted=[], eviction_order=[], last_failure=None,
        )  # fmt: skip
        status = nodecache_status(**{**base, **kw})  # type: ignore[arg-type]
        return next(c for c in status["conditions"] if c["type"] == "Degraded")

    bad = ("InvalidPeerSettings", "ConfigMap preheat-system/preheat-settings: bad")
    cond = degraded(degraded=bad)
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", *bad)
    failed = [WantedRevision("r1", "http://o/m", "Failed")]
    both = degraded(degraded=bad, pending=failed, last_failure={"message": "r1: 503"})
    assert both["reason"] == "InvalidPeerSettings" and both["message"].endswith(
        "; warm-up failed: r1: 503"
    )
    later = degraded(degraded=bad, now="2026-12-01T12:05:00Z", previous={"conditions": [cond]})
    assert later["lastTransitionTime"] == "2026-12-01T12:00:00Z"
    assert degraded()["reason"] == "AsExpected" and degraded()["status"] == "False"
    assert degraded(pending=failed, last_failure={"message": "x"})["reason"] == "WarmupFailed"
