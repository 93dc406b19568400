"""Peer-to-peer warm-up between node agents on a real v1.20.2 control plane.

Three stand-in nodes, one `preheat agent --peer-port ... --peer-token-file ...` process per
node (authenticated as the preheat-agent ServiceAccount, bound to the rendered agent
ClusterRole and its namespaced peer Role), the origin budget in the rendered
`preheat-settings` ConfigMap, and a real nginx origin whose access log counts every body
byte it sends. What is checked: bytes at the origin, NodeCache status (`peer`,
`warmups`), the origin slot Leases, `/metrics`, and the peer servers' answers.
"""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from preheat.bench.models import generate_model, write_http_manifest
from preheat.runtime.kubernetes.render import system_manifests
from preheat.store import NodeStore
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import HttpOrigin, nginx_origin, origin_bytes_sent
from preheat.testing.procs import free_port
from tests.integration.test_k8s_agent import Agent, _create_cache, _nodecache

pytestmark = pytest.mark.kubernetes

NS = "k8s-peers"
NODES = ("peer-a", "peer-b", "peer-c")
MDC = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/modeldatacaches"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/preheat-system/leases"
SETTINGS = "/api/v1/namespaces/preheat-system/configmaps/preheat-settings"
SIZE_1 = 40_000_000  # 2 shards of 20 MB: 2 pieces of 16 MiB each
SIZE_2 = 32_000_000
#: m3, for the filling seed: blobs that land one after another under one origin budget,
#: the first with two pieces of which the short one lands first.
SEED_FILES = {"a.bin": 17 << 20, "b.bin": 4_000_000, "c.bin": 12_000_000, "d.bin": 16_000_000}


class PeerAgent(Agent):
    """An agent serving peers on its own port with the token from a file."""

    def __init__(self, node: str, store: Path, kubeconfig: Path, log: Path, token: Path) -> None:
        super().__init__(node, store, kubeconfig, log)
        self.token_file = token
        self.peer_port = free_port()

    def argv(self) -> list[str]:
        return [
            *super().argv(), "--peer-port", str(self.peer_port),
            "--peer-token-file", str(self.token_file), "--lease-seconds", "3",
        ]  # fmt: skip

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


@dataclass
class World:
    kube: KubeCluster
    origin: HttpOrigin
    access_log: Path
    urls: dict[str, str]  # model name -> manifest URL
    token: str
    agents: dict[str, PeerAgent]


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's share of the session cluster (namespace k8s-peers, three nodes), the
    rendered agent RBAC and settings (concurrentFills 1), two models behind nginx, a token
    file, and one peer-serving agent per node."""
    base = tmp_path_factory.mktemp("k8s-peers")
    for name, size in (("m1", SIZE_1), ("m2", SIZE_2)):
        generate_model(base / "origin" / name, size, shards=2, seed=len(name) + size % 7)
        write_http_manifest(base / "origin" / name)
    rng = random.Random(3)
    for fname, fsize in SEED_FILES.items():
        (base / "origin" / "m3").mkdir(exist_ok=True)
        (base / "origin" / "m3" / fname).write_bytes(rng.randbytes(fsize))
    write_http_manifest(base / "origin" / "m3")
    for name in ("m4a", "m4b"):  # tiny: a warm-up that reads the settings
        generate_model(base / "origin" / name, 200_000, shards=1, seed=len(name))
        write_http_manifest(base / "origin" / name)
    token = secrets.token_urlsafe(32)
    token_file = base / "peer-token"
    token_file.write_text(token + "\n")
    log = base / "access.log"
    with (
        kube_share(kube_session, namespaces=[NS], nodes={n: {} for n in NODES}) as kube,
        nginx_origin(base / "origin", access_log=log) as origin,
    ):
        system = [
            m
            for m in system_manifests()
            if m["kind"] in {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"}
            or (
                m["metadata"]["name"] == "preheat-agent"
                and m["kind"] in {"ClusterRole", "ClusterRoleBinding"}
            )
        ]
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(system))
        _set_settings(kube, {"origin": {"budget": {"concurrentFills": 1}}})
        conf = kube.sa_kubeconfig(base / "agent.kubeconfig", "preheat-system", "preheat-agent")
        agents = {
            n: PeerAgent(n, base / n / "store", conf, base / f"{n}.log", token_file) for n in NODES
        }
        try:
            for a in agents.values():
                a.start()
            urls = {
                m: origin.url(f"{m}/preheat-manifest.json")
                for m in ("m1", "m2", "m3", "m4a", "m4b")
            }
            yield World(kube, origin, log, urls, token, agents)
        finally:
            for a in agents.values():
                a.stop()


def _set_settings(kube: KubeCluster, settings: dict[str, Any]) -> None:
    patch = {"data": {"settings.yaml": yaml.safe_dump(settings)}}
    kube.rest().must("PATCH", SETTINGS, patch, content_type="application/merge-patch+json")


def _ready(kube: KubeCluster, node: str, revision: str | None = None) -> dict[str, Any] | None:
    status = _nodecache(kube, node).get("status") or {}
    for r in status.get("revisions") or ():
        if r["state"] == "Ready" and (revision is None or r["revision"] == revision):
            return status
    return None


def _warmups(kube: KubeCluster, node: str, revision: str) -> dict[str, Any] | None:
    status = _nodecache(kube, node).get("status") or {}
    found = [w for w in status.get("warmups") or () if w["revision"] == revision]
    return found[-1] if found else None


def test_three_agents_fetch_one_copy_from_the_origin_and_the_rest_from_peers(
    world: World,
) -> None:
    """With concurrentFills 1 and a stale origin slot Lease held by a dead agent, the slot
    is taken over after its duration, one agent fills from the origin, the other two from
    peers: nginx sends <= 1.10x the model, each NodeCache lists its peer URL and blobs,
    status.warmups and /metrics say where the bytes came from, and the slot ends free."""
    kube = world.kube
    ghost = {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "preheat-origin-0", "labels": {"preheat.dev/origin-slot": "true"}},
        "spec": {"holderIdentity": "gone-node/x", "leaseDurationSeconds": 3,
                 "renewTime": "2020-01-01T00:00:00.000000Z"},
    }  # fmt: skip
    kube.rest().must("POST", LEASES, ghost)
    sent_before = origin_bytes_sent(world.access_log)
    revision, manifest = NodeStore(world.access_log.parent / "probe").resolve(world.urls["m1"])
    _create_cache(kube, "m1", world.urls["m1"], revision, list(NODES), namespace=NS)
    for n in NODES:
        until(f"{n} Ready", lambda n=n: _ready(kube, n, revision), timeout=90)
        until(f"{n} warm-up recorded", lambda n=n: _warmups(kube, n, revision), timeout=30)
    size = sum(f.size for f in manifest.files)
    sent = origin_bytes_sent(world.access_log) - sent_before
    assert sent <= 1.10 * size, f"origin sent {sent} bytes for a {size}-byte model"
    records = {n: _warmups(kube, n, revision) for n in NODES}
    modes = sorted(r["mode"] for r in records.values() if r)
    assert modes == ["origin", "peer", "peer"], records
    blobs = {f.sha256 for f in manifest.files if f.sha256}
    for n, rec in records.items():
        assert rec is not None and sum(rec["bytesFrom"].values()) == size, (n, rec)
        if rec["mode"] == "peer":
            assert rec["bytesFrom"]["peer"] == size and not rec["bytesFrom"]["origin"]
        status = _nodecache(kube, n)["status"]
        assert status["peer"]["url"] == world.agents[n].peer_url
        assert blobs <= set(status["peer"]["blobs"])
        line = f'preheat_warmup_bytes{{node="{n}",revision="{revision}",source="{rec["mode"]}"}}'
        assert world.agents[n].metric(line) == rec["bytesFrom"][rec["mode"]], line
        other = "peer" if rec["mode"] == "origin" else "origin"
        fetched = world.agents[n].metric
        assert fetched(f'preheat_agent_bytes_fetched_total{{source="{rec["mode"]}"}}') == size
        assert fetched(f'preheat_agent_bytes_fetched_total{{source="{other}"}}') == 0
    print(f"\nk8s peers: origin sent {sent} B for a {size} B model ({sent / size:.4f}x); "
          f"warm-ups {json.dumps(records, sort_keys=True)}")  # fmt: skip
    seed = next(n for n, r in records.items() if r and r["mode"] == "origin")
    assert "took over origin slot preheat-origin-0 from gone-node/x" in (
        world.agents[seed].log.read_text()
    )
    lease = kube.rest().get(f"{LEASES}/preheat-origin-0")
    assert not lease["spec"].get("holderIdentity"), lease  # freed when the fill ended


def test_an_agent_killed_mid_serve_costs_a_retry_not_a_failed_warm_up(world: World) -> None:
    """peer-c warms a 32 MB revision from peer-a and peer-b at 8 MB/s (origin.bandwidth, the node link);
    peer-a is SIGKILLed while peer-c is part-way: peer-c still ends Ready with every byte
    verified, no failed warm-up, and its bytes from peers (and the origin for what peer-a
    did not deliver)."""
    kube, a = world.kube, world.agents["peer-a"]
    revision, manifest = NodeStore(world.access_log.parent / "probe2").resolve(world.urls["m2"])
    size = sum(f.size for f in manifest.files)
    _create_cache(kube, "m2", world.urls["m2"], revision, ["peer-a", "peer-b"], namespace=NS)
    for n in ("peer-a", "peer-b"):
        until(f"{n} Ready", lambda n=n: _ready(kube, n, revision), timeout=90)
    _set_settings(kube, {"origin": {"bandwidth": "8MB/s"}})
    patch = {"spec": {"nodes": {"names": list(NODES)}}}
    kube.rest().must("PATCH", f"{MDC}/m2", patch, content_type="application/merge-patch+json")

    def filling() -> int | None:
        for r in (_nodecache(kube, "peer-c").get("status") or {}).get("revisions") or ():
            if r["revision"] == revision and r["state"] == "Filling" and r.get("bytes"):
                return int(r["bytes"])
        return None

    done_at_kill = until("peer-c part-way", filling, timeout=60)
    a.kill()
    try:
        assert done_at_kill < size
        until("peer-c Ready", lambda: _ready(kube, "peer-c", revision), timeout=90)
        rec = until("peer-c recorded", lambda: _warmups(kube, "peer-c", revision), timeout=30)
        assert rec["mode"] == "peer" and sum(rec["bytesFrom"].values()) == size, rec
        assert rec["bytesFrom"]["peer"] > 0
        print(f"\nk8s peers, peer-a killed at {done_at_kill} of {size} B: peer-c {rec}")
        assert world.agents["peer-c"].metric('preheat_agent_warmups_total{outcome="failed"}') == 0
        store = NodeStore(world.agents["peer-c"].store)
        assert store.verify(quarantine=False).ok
    finally:
        _set_settings(kube, {"origin": {"budget": {"concurrentFills": 1}}})
        a.start()


def test_snapshot_init_on_a_cold_node_fills_from_the_agents_peers(
    world: World, tmp_path: Path
) -> None:
    """`preheat snapshot-init` with the token file and an agent's peer URL, on a node store
    without the snapshot, takes every model byte from the peer (nginx sends only the
    manifest) and links --out to a verified snapshot."""
    revision, manifest = NodeStore(tmp_path / "probe").resolve(world.urls["m1"])
    size = sum(f.size for f in manifest.files)
    sent_before = origin_bytes_sent(world.access_log)
    exe = Path(sys.executable).parent / "preheat"
    argv = [
        str(exe), "snapshot-init", "--store", str(tmp_path / "node-store"),
        "--source", world.urls["m1"], "--revision", revision, "--digest", manifest.digest,
        "--out", str(tmp_path / "pod" / "model"),
        "--peer-token-file", str(world.agents["peer-b"].token_file),
        "--peer", world.agents["peer-b"].peer_url,
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["warm"] and out["bytes_from"] == {"peer": size}, out
    assert origin_bytes_sent(world.access_log) - sent_before < 64 << 10
    assert NodeStore(tmp_path / "pod" / "store").verify(quarantine=False).ok
    assert world.token not in proc.stdout + proc.stderr


def _peer_get(url: str, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code)


def test_peer_servers_want_the_token_and_never_show_it(world: World) -> None:
    """An agent's peer server answers 401 without the token or with a wrong one, 200 with
    it; the token is in no agent log and no NodeCache."""
    kube, b = world.kube, world.agents["peer-b"]
    status = until("peer-b holds a blob", lambda: _ready(kube, "peer-b"))
    digest = status["peer"]["blobs"][0]
    url = f"{b.peer_url}/blobs/sha256:{digest}/pieces"
    assert _peer_get(url, {}) == 401
    assert _peer_get(url, {"Authorization": "Bearer " + "x" * 43}) == 401
    assert _peer_get(url, {"Authorization": f"Bearer {world.token}"}) == 200
    for a in world.agents.values():
        assert world.token not in a.log.read_text()
    every = json.dumps(kube.rest().get("/apis/preheat.dev/v1alpha1/nodecaches"))
    assert world.token not in every


def test_receivers_start_from_a_seed_that_is_still_filling(world: World) -> None:
    """With concurrentFills 1 and the origin budget at 6 MB/s, the seed publishes its fill
    progress (status.peer.filling: pieces landed) and the blobs it has published while
    its fill runs; the other two agents start from it at once: they hold bytes of the
    revision while the seed is not Ready yet, take every byte from peers, nginx sends
    about one copy, and the seed's status writes stay within one per second."""
    kube = world.kube
    revision, manifest = NodeStore(world.access_log.parent / "probe3").resolve(world.urls["m3"])
    size = sum(f.size for f in manifest.files)
    _set_settings(kube, {"origin": {"budget": {"concurrentFills": 1, "bandwidth": "6MB/s"}}})
    writes = {n: a.metric("preheat_agent_status_writes_total") for n, a in world.agents.items()}
    sent_before = origin_bytes_sent(world.access_log)
    seen: dict[str, Any] = {"progress": None, "early": None}
    seed: list[str] = []

    def look() -> bool:
        items = kube.rest().get("/apis/preheat.dev/v1alpha1/nodecaches")["items"]
        states = {o["metadata"]["name"]: o.get("status") or {} for o in items}
        if not seed:
            holder = kube.rest().get(f"{LEASES}/preheat-origin-0")["spec"].get("holderIdentity")
            if holder and holder.endswith(revision):
                seed.append(holder.split("/")[0])
            return False
        rows = {
            n: {r["revision"]: r for r in st.get("revisions") or ()} for n, st in states.items()
        }
        seed_row = rows.get(seed[0], {}).get(revision)
        if seed_row is not None and seed_row["state"] != "Ready":
            progress = (states[seed[0]].get("peer") or {}).get("filling")
            if progress and seen["progress"] is None:
                seen["progress"] = progress
            for n in NODES:
                row = rows.get(n, {}).get(revision)
                if n != seed[0] and row and row.get("bytes", 0) >= 1 << 20 and not seen["early"]:
                    seen["early"] = (n, row["bytes"], seed_row.get("bytes"))
        return all(_warmups(kube, n, revision) for n in NODES)

    try:
        _create_cache(kube, "m3", world.urls["m3"], revision, list(NODES), namespace=NS)
        until("m3 warmed on every node", look, timeout=120, interval=0.2)
    finally:
        _set_settings(kube, {"origin": {"budget": {"concurrentFills": 1}}})
    sent = origin_bytes_sent(world.access_log) - sent_before
    records = {n: _warmups(kube, n, revision) for n in NODES}
    print(f"\nk8s filling seed {seed}: origin sent {sent} B for {size} B ({sent / size:.4f}x); "
          f"first receiver bytes before the seed was Ready {seen['early']}; seed progress "
          f"{seen['progress']}; warm-ups {json.dumps(records, sort_keys=True)}")  # fmt: skip
    assert sent <= 1.10 * size, f"origin sent {sent} bytes for a {size}-byte model"
    assert seen["early"] is not None, "no receiver held bytes before the seed was Ready"
    assert seen["progress"] and all(
        {"blob", "pieces", "landed", "verified"} <= set(e) for e in seen["progress"]
    ), seen["progress"]
    for n, rec in records.items():
        assert rec is not None and sum(rec["bytesFrom"].values()) == size, (n, rec)
        if n == seed[0]:
            assert rec["mode"] == "origin" and rec["bytesFrom"]["origin"] == size, rec
        else:
            assert rec["mode"] == "peer" and rec["bytesFrom"]["peer"] == size, rec
            assert "seeds " + seed[0] in world.agents[n].log.read_text()
    seed_rec = records[seed[0]]
    assert seed_rec is not None
    wrote = world.agents[seed[0]].metric("preheat_agent_status_writes_total") - writes[seed[0]]
    assert wrote <= seed_rec["seconds"] / 1.0 + 8, (wrote, seed_rec)


def _condition(kube: KubeCluster, node: str, kind: str) -> dict[str, Any]:
    conds = (_nodecache(kube, node).get("status") or {}).get("conditions") or ()
    return next((c for c in conds if c["type"] == kind), {})


def _events(kube: KubeCluster, node: str, reason: str) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "events", "-A", "-o", "json", "--field-selector",
        f"involvedObject.kind=NodeCache,involvedObject.name={node},reason={reason}",
    )  # fmt: skip
    return list(json.loads(out.stdout)["items"])


def test_invalid_peer_settings_show_on_the_nodecache_and_do_not_fail_warm_ups(
    world: World,
) -> None:
    """A preheat-settings ConfigMap whose settings.yaml does not validate: peer-b's next
    warm-up still ends Ready (the last valid settings are kept), its NodeCache says
    Degraded=True InvalidPeerSettings with the error, one Warning Event names it
    (kubectl describe shows it); once fixed, Degraded clears and a Normal Event says so."""
    kube = world.kube
    bad = {"data": {"settings.yaml": "origin:\n  budget: {concurrentFills: 0}\n"}}
    kube.rest().must("PATCH", SETTINGS, bad, content_type="application/merge-patch+json")
    try:
        for name in ("m4a", "m4b"):
            if name == "m4b":
                _set_settings(kube, {"origin": {"budget": {"concurrentFills": 1}}})
            rev, _ = NodeStore(world.access_log.parent / f"probe-{name}").resolve(world.urls[name])
            _create_cache(kube, name, world.urls[name], rev, ["peer-b"], namespace=NS)
            until(f"peer-b holds {name}", lambda rev=rev: _ready(kube, "peer-b", rev), timeout=60)
            if name == "m4a":
                cond = until(
                    "Degraded InvalidPeerSettings",
                    lambda: (
                        (c := _condition(kube, "peer-b", "Degraded")).get("reason")
                        == "InvalidPeerSettings"
                        and c
                    ),
                    timeout=30,
                )
                assert cond["status"] == "True", cond
                assert "concurrentFills 0 must be at least 1" in cond["message"], cond
                (event,) = until(
                    "the Warning Event", lambda: _events(kube, "peer-b", "InvalidPeerSettings")
                )
                assert event["type"] == "Warning" and "concurrentFills 0" in event["message"]
                described = kube.kubectl("describe", "nodecache", "peer-b").stdout
                assert "InvalidPeerSettings" in described, described
    finally:
        _set_settings(kube, {"origin": {"budget": {"concurrentFills": 1}}})
    cond = until(
        "Degraded cleared",
        lambda: (c := _condition(kube, "peer-b", "Degraded")).get("status") == "False" and c,
        timeout=30,
    )
    assert cond["reason"] == "AsExpected", cond
    (fixed,) = until("the Normal Event", lambda: _events(kube, "peer-b", "PeerSettingsValid"))
    assert fixed["type"] == "Normal"
    assert world.agents["peer-b"].metric('preheat_agent_warmups_total{outcome="failed"}') == 0
