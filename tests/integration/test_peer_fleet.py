"""The local fleet's warm-up fan-out: one copy from the origin, the rest from peers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from preheat.control.spec import ClusterSpec, parse_cluster
from preheat.runtime.local import LocalFleet
from preheat.testing.fleet import endpoint_spec, make_model, start_records
from preheat.testing.origins import nginx_origin, origin_bytes_sent

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


def _cluster(base: Path, n: int, **top: Any) -> ClusterSpec:
    nodes = [{"name": f"n{i}", "capacity": "1GiB", "slots": 1} for i in range(n)]
    return parse_cluster({"nodes": nodes, **top}, base_dir=base)


def _all_ready(fleet: LocalFleet, revision: str) -> bool:
    return all(
        n["cache"].get(revision, {}).get("state") == "ready" for n in fleet.status()["nodes"]
    )


async def test_four_nodes_fetch_one_copy_from_the_origin(tmp_path: Path) -> None:
    """Warming 4 nodes with no budget configured moves one copy from the origin; the other
    three take every byte from peers; status shows each warm-up and the origin bytes per
    revision; the cluster token is required by every peer server and shows up nowhere."""
    model = make_model(tmp_path / "origin" / "m", size=24 * MB, shards=3, seed=3)
    access = tmp_path / "access.log"
    with nginx_origin(tmp_path / "origin", access_log=access) as origin:
        spec = endpoint_spec(
            "chat", model.http_ref(origin.base_url, tmp_path / "origin"), cache={"enabled": True}
        )
        cluster = _cluster(tmp_path, 4, origin={"bandwidth": "40MB/s"})
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "resolve")
            rev = fleet.status()["variants"][0]["revision"]
            await fleet.wait_until(lambda f: _all_ready(f, rev), 90, "every node warm")
            await fleet.wait_until(lambda f: len(f.status()["warmups"]) == 4, 10, "records")
            status = fleet.status()
            assert fleet.fetched_bytes(rev) == model.size
            assert status["revisions"][rev]["origin_bytes"] == model.size
            modes = sorted(w["mode"] for w in status["warmups"])
            assert modes == ["origin", "peer", "peer", "peer"], status["warmups"]
            for w in status["warmups"]:
                assert w["bytes_from"] == {w["mode"]: model.size}, w
                assert w["seconds"] > 0
            peers = fleet.warmer.peers
            assert peers is not None and not peers.avoided
            servers = [peers.server(n) for n in fleet.nodes]
            assert all(s is not None for s in servers)
            served = sum(s.bytes_served for s in servers if s is not None)
            assert served == 3 * model.size
            token = peers._token
            url = servers[0].url + "/blobs/sha256:" + "0" * 64  # type: ignore[union-attr]
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                assert r.status == 401
            metrics = fleet.metrics_text().decode()
            samples = [
                (x.name, x.labels, x.value)
                for fam in text_string_to_metric_families(metrics)
                for x in fam.samples
                if x.name.startswith(("preheat_warmup", "preheat_revision"))
            ]
            assert ("preheat_revision_origin_bytes", {"revision": rev}, model.size) in samples
            by_source = [v for n, lab, v in samples if lab.get("source") == "peer" and v]
            assert by_source == [model.size] * 3
            assert sum(1 for n, _, v in samples if n == "preheat_warmup_seconds" and v > 0) == 4
            text = json.dumps(await fleet.full_status()) + metrics
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "the replica")
            log = (tmp_path / "state" / "logs" / "fleet.log").read_text()
            events = (tmp_path / "state" / "events.jsonl").read_text()
            assert token not in text and token not in log and token not in events
        # counted at the origin: one copy plus the manifest, fetched once per resolve
        assert model.size <= origin_bytes_sent(access) <= model.size * 1.01


async def test_peer_dying_mid_transfer_never_fails_a_warm_up(tmp_path: Path) -> None:
    """The seed's peer server dies while the other nodes fetch from it: they retry from
    another peer or the origin, no warm-up is ever reported failed, every node is warm."""
    model = make_model(tmp_path / "origin" / "m", size=32 * MB, shards=2, seed=6)
    with nginx_origin(tmp_path / "origin") as origin:
        spec = endpoint_spec(
            "chat", model.http_ref(origin.base_url, tmp_path / "origin"), cache={"enabled": True}
        )
        cluster = _cluster(tmp_path, 3, origin={"bandwidth": "16MB/s"})
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "resolve")
            rev = fleet.status()["variants"][0]["revision"]
            peers = fleet.warmer.peers
            assert peers is not None
            states: set[str] = set()

            def serving(f: LocalFleet) -> bool:
                for n in f.status()["nodes"]:
                    states.add(n["cache"].get(rev, {}).get("state", "absent"))
                return any(
                    (s := peers.server(n)) is not None and s.bytes_served > 4 * MB for n in f.nodes
                )

            await fleet.wait_until(serving, 60, "a seed serving its peers")
            live = {n: s for n in fleet.nodes if (s := peers.server(n)) is not None}
            server = max(live.values(), key=lambda s: s.bytes_served)
            await server.stop()

            def warm(f: LocalFleet) -> bool:
                for n in f.status()["nodes"]:
                    states.add(n["cache"].get(rev, {}).get("state", "absent"))
                return _all_ready(f, rev)

            await fleet.wait_until(warm, 90, "every node warm")
            assert "failed" not in states
            assert fleet.fetched_bytes(rev) < 3 * model.size


async def test_peers_off_is_todays_behaviour(tmp_path: Path) -> None:
    """With ``peers.enabled: false`` each node fetches its own copy from the origin."""
    model = make_model(tmp_path / "origin" / "m", size=6 * MB, shards=2, seed=4)
    spec = endpoint_spec("chat", model.ref, cache={"enabled": True})
    cluster = _cluster(tmp_path, 3, peers={"enabled": False})
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "resolve")
        rev = fleet.status()["variants"][0]["revision"]
        await fleet.wait_until(lambda f: _all_ready(f, rev), 60, "every node warm")
        assert fleet.warmer.peers is None
        got = {n: fleet.origin_bytes[(n, rev)] for n in fleet.nodes}
        size = fleet.status()["variants"][0]["model_bytes"]
        assert got == dict.fromkeys(fleet.nodes, size)


async def test_a_replica_on_a_cold_node_pulls_from_the_warm_peers(tmp_path: Path) -> None:
    """Two target nodes warm (one origin copy); a third replica lands on the cold,
    non-target node and pulls every byte from those peers: its start record says `peer`
    (a cache miss) and the origin sent one copy in all."""
    model = make_model(tmp_path / "origin" / "m", size=6 * MB, shards=2, seed=8)
    access = tmp_path / "access.log"
    with nginx_origin(tmp_path / "origin", access_log=access) as origin:
        spec = endpoint_spec(
            "chat",
            model.http_ref(origin.base_url, tmp_path / "origin"),
            replicas=3,
            cache={"enabled": True, "nodes": ["n0", "n1"]},
        )
        cluster = _cluster(tmp_path, 3, origin={"bandwidth": "40MB/s"})
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            await fleet.wait_until(lambda f: f.ready_count() == 3, 90, "three replicas")
            recs = {r.node: r for r in start_records(fleet.events.path)}
            assert recs["n2"].weights_source == "peer" and not recs["n2"].cache_hit, recs["n2"]
            assert recs["n2"].bytes_from.get("peer") == model.size
            assert recs["n2"].bytes_from.get("origin", 0) == 0
            assert recs["n0"].weights_source == recs["n1"].weights_source == "cache"
        assert model.size <= origin_bytes_sent(access) <= model.size * 1.01


async def test_receivers_fetch_from_a_seed_that_is_still_filling(tmp_path: Path) -> None:
    """Three nodes warm at once: the two receivers take the seed's landed pieces while
    its origin fill is still running (peer servers send bytes before any node is warm),
    and the origin sends one copy in all."""
    model = make_model(tmp_path / "origin" / "m", size=40 * MB, shards=1, seed=9)
    access = tmp_path / "access.log"
    with nginx_origin(tmp_path / "origin", access_log=access) as origin:
        spec = endpoint_spec(
            "chat", model.http_ref(origin.base_url, tmp_path / "origin"), cache={"enabled": True}
        )
        cluster = _cluster(tmp_path, 3, origin={"bandwidth": "10MB/s"})
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            await fleet.wait_until(lambda f: f.status()["variants"][0]["revision"], 30, "resolve")
            rev = fleet.status()["variants"][0]["revision"]
            peers = fleet.warmer.peers
            assert peers is not None
            early: list[int] = []

            def served_early(f: LocalFleet) -> bool:
                if any(
                    n["cache"].get(rev, {}).get("state") == "ready" for n in f.status()["nodes"]
                ):
                    return True
                sent = sum(s.bytes_served for n in f.nodes if (s := peers.server(n)) is not None)
                if sent:
                    early.append(sent)
                return bool(sent)

            await fleet.wait_until(served_early, 60, "a first piece served or a node warm")
            assert early, "no peer served a byte before the seed finished"
            await fleet.wait_until(lambda f: _all_ready(f, rev), 60, "every node warm")
            await fleet.wait_until(lambda f: len(f.status()["warmups"]) == 3, 10, "records")
            modes = sorted(w["mode"] for w in fleet.status()["warmups"])
            assert modes == ["origin", "peer", "peer"], fleet.status()["warmups"]
            assert fleet.fetched_bytes(rev) == model.size
        assert model.size <= origin_bytes_sent(access) <= model.size * 1.01
