"""The node agent's warm-up admission with peers off, on a real v1.20.2 control plane.

One stand-in node, one `preheat agent --peer-port ...` whose settings (its own namespace's
`preheat-settings` ConfigMap) say `peers: {enabled: false}` and `concurrentFills: 1`, a
store with room for one model, and two 1 MB models behind nginx. What is checked: a
warm-up waits for an origin slot Lease (holders are not peers), and a warm-up's fill does
not evict another warm-up's copy that no pod has used yet; and a plain `preheat agent`
(no peer flags, `--namespace` this module's) on a second node keeps to the same budget.
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
from tests.integration.test_k8s_agent import Agent, _create_cache, _nodecache
from tests.integration.test_k8s_peers import PeerAgent, _ready

pytestmark = pytest.mark.kubernetes

NS = "k8s-swarm"
NODE = "swarm-a"
PLAIN = "swarm-plain"
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
        kube_share(kube_session, namespaces=[NS], nodes={NODE: {}, PLAIN: {}}) as kube,
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


def test_a_warmed_copy_no_cache_wants_any_more_gives_its_room(world: World) -> None:
    """Once the first copy's ``ModelDataCache`` is deleted (a rollout finished, say), that
    copy is no warm-up's work any more: the deferred warm-up's next retry evicts it and
    fills. The old agent spared every unused warmed copy, wanted or not, so the second
    warm-up was deferred for good."""
    kube = world.kube
    first, second = _revision(world, "s1"), _revision(world, "s2")
    assert _ready(kube, NODE, first) and not _ready(kube, NODE, second)  # the test above
    kube.rest().must("DELETE", f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/modeldatacaches/s1")
    until("s2 Ready", lambda: _ready(kube, NODE, second), timeout=60)
    status = _nodecache(kube, NODE)["status"]
    held = {r["revision"] for r in status["revisions"] if r["state"] == "Ready"}
    assert held == {second}, status["revisions"]
    assert not NodeStore(world.agent.store).has(first)


class PlainAgent(Agent):
    """An agent without peer flags whose settings and slot Leases are this module's."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--namespace", NS]


def _hold_slot(kube: KubeCluster, holder: str | None) -> None:
    """Set the holder of the only origin slot Lease (created when absent)."""
    spec = {"holderIdentity": holder, "leaseDurationSeconds": 3600}
    status, out = kube.rest().call("PATCH", f"{LEASES}/preheat-origin-0", {"spec": spec},
                                   content_type="application/merge-patch+json")  # fmt: skip
    if status == 404:
        meta = {"name": "preheat-origin-0", "labels": {"preheat.dev/origin-slot": "true"}}
        kube.rest().must("POST", LEASES, {"apiVersion": "coordination.k8s.io/v1",
                                          "kind": "Lease", "metadata": meta, "spec": spec})  # fmt: skip
    elif status != 200:
        raise AssertionError(f"PATCH of the origin slot Lease answered {status}: {out}")


def test_an_agent_without_peer_flags_keeps_to_the_origin_budget(world: World) -> None:
    """An agent started without ``--peer-port`` reads ``preheat-settings`` too: while
    another node holds the only origin slot Lease its warm-up waits, then takes the slot,
    fills and frees it; it publishes no ``status.peer``."""
    kube = world.kube
    base = world.agent.store.parent
    # the other tests' node stops retrying its deferred warm-up (it would take the slot)
    kube.rest().call("DELETE", f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/modeldatacaches/s2")
    _hold_slot(kube, "other-node/x")  # the Lease the first test made and freed
    plain = PlainAgent(PLAIN, base / "plain-store", kube.kubeconfig, base / "plain.log")
    try:
        plain.start()
        revision = _revision(world, "s2")
        _create_cache(kube, "plain", world.urls["s2"], revision, [PLAIN], namespace=NS)
        until(
            "plain warm-up waiting for the slot",
            lambda: "waiting for an origin slot for" in plain.log.read_text(),
            timeout=30,
        )
        time.sleep(0.5)  # a moment later: still waiting, nothing held
        assert _ready(kube, PLAIN, revision) is None, _nodecache(kube, PLAIN).get("status")
        _hold_slot(kube, None)
        until("plain Ready", lambda: _ready(kube, PLAIN, revision), timeout=30)
        lease = kube.rest().get(f"{LEASES}/preheat-origin-0")
        assert not lease["spec"].get("holderIdentity"), lease  # it freed its slot
        assert "peer" not in (_nodecache(kube, PLAIN).get("status") or {})
    finally:
        plain.stop()
