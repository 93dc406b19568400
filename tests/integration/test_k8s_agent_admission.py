"""The node agent's warm-up admission with peers off, on a real v1.20.2 control plane.

One stand-in node, one `preheat agent --peer-port ...` whose settings (its own namespace's
`preheat-settings` ConfigMap) say `peers: {enabled: false}` and `concurrentFills: 1`, a
store with room for one model, and two 1 MB models behind nginx. What is checked: a
warm-up waits for an origin slot Lease (holders are not peers), and a warm-up's fill does
not evict another warm-up's copy that no pod has used yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from preheat.bench.models import generate_model, write_http_manifest
from preheat.store import NodeStore
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import nginx_origin
from tests.integration.test_k8s_agent import _create_cache, _nodecache
from tests.integration.test_k8s_peers import PeerAgent, _ready

pytestmark = pytest.mark.kubernetes

NS = "k8s-swarm"
NODE = "swarm-a"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
SIZE = 1_000_000


class SwarmAgent(PeerAgent):
    """A peer agent whose settings and origin slot Leases live in this module's namespace,
    with room for one model."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--namespace", NS, "--capacity", "1500000"]


@dataclass
class World:
    kube: KubeCluster
    urls: dict[str, str]
    agent: SwarmAgent


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's namespace and node, settings with peers off and one origin slot, two
    models behind nginx, and the agent."""
    base = tmp_path_factory.mktemp("k8s-swarm")
    for i, name in enumerate(("s1", "s2")):
        generate_model(base / "origin" / name, SIZE, shards=1, seed=11 + i)
        write_http_manifest(base / "origin" / name)
    token = base / "peer-token"
    token.write_text("swarm-token-" + "x" * 32 + "\n")
    settings = {"origin": {"budget": {"concurrentFills": 1}}, "peers": {"enabled": False}}
    cm = {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "preheat-settings"},
        "data": {"settings.yaml": yaml.safe_dump(settings)},
    }  # fmt: skip
    with (
        kube_share(kube_session, namespaces=[NS], nodes={NODE: {}}) as kube,
        nginx_origin(base / "origin") as origin,
    ):
        kube.rest().must("POST", f"/api/v1/namespaces/{NS}/configmaps", cm)
        agent = SwarmAgent(NODE, base / "store", kube.kubeconfig, base / "agent.log", token)
        try:
            agent.start()
            urls = {m: origin.url(f"{m}/preheat-manifest.json") for m in ("s1", "s2")}
            yield World(kube, urls, agent)
        finally:
            agent.stop()


def _revision(world: World, name: str) -> str:
    return NodeStore(world.agent.store.parent / f"probe-{name}").resolve(world.urls[name])[0]


def test_with_peers_off_a_warm_up_waits_for_an_origin_slot_lease(world: World) -> None:
    """While another node holds the only origin slot Lease, the warm-up waits (and says
    so in the log) instead of pulling at once; once the slot is free it fills."""
    kube = world.kube
    ghost = {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "preheat-origin-0", "labels": {"preheat.dev/origin-slot": "true"}},
        "spec": {"holderIdentity": "other-node/x", "leaseDurationSeconds": 3600},
    }  # fmt: skip
    kube.rest().must("POST", LEASES, ghost)
    revision = _revision(world, "s1")
    _create_cache(kube, "s1", world.urls["s1"], revision, [NODE], namespace=NS)
    until(
        "warm-up waiting for the slot",
        lambda: "waiting for an origin slot for" in world.agent.log.read_text(),
        timeout=30,
    )
    time.sleep(1.5)  # a few polls: still waiting, nothing held
    assert _ready(kube, NODE, revision) is None, _nodecache(kube, NODE).get("status")
    patch = {"spec": {"holderIdentity": None}}
    kube.rest().must(
        "PATCH", f"{LEASES}/preheat-origin-0", patch, content_type="application/merge-patch+json"
    )
    until("s1 Ready", lambda: _ready(kube, NODE, revision), timeout=30)
    lease = kube.rest().get(f"{LEASES}/preheat-origin-0")
    assert not lease["spec"].get("holderIdentity"), lease  # the agent freed its slot


def test_a_warm_up_never_evicts_an_unused_warmed_copy(world: World) -> None:
    """With room for one model, the second warm-up fails with the reason (retried) and the
    first warm-up's copy, which no pod has used, stays held."""
    kube = world.kube
    first = _revision(world, "s1")
    until("s1 Ready", lambda: _ready(kube, NODE, first), timeout=60)
    second = _revision(world, "s2")
    _create_cache(kube, "s2", world.urls["s2"], second, [NODE], namespace=NS)

    def deferred() -> dict[str, object] | None:
        failure = (_nodecache(kube, NODE).get("status") or {}).get("lastFailure") or {}
        return failure if "no replica has used yet" in str(failure) else None

    failure = until("s2 deferred", deferred, timeout=30)
    time.sleep(1.0)  # a retry or two later
    status = _nodecache(kube, NODE)["status"]
    held = {r["revision"] for r in status["revisions"] if r["state"] == "Ready"}
    assert held == {first}, (status["revisions"], failure)
    assert "WarmupDeferred" in str(failure) and "warmed copy" in str(failure), failure
