"""The node agent's NodeCache follows its store on a real v1.20.2 control plane: a copy
evicted behind the agent's back leaves the status (and the Node label) within about a
second, not at the next resync.

One stand-in node and one `preheat agent` with `--resync 30`, so only its look at the
store's `snapshots/` (`runtime.kubernetes.agent_store_watch`) can be what notices; the
copy is evicted by `preheat cache evict`, a second process on the agent's store.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from preheat.bench.models import generate_model, write_http_manifest
from preheat.runtime.kubernetes.nodecache_status import revision_label
from preheat.store import NodeStore
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import nginx_origin
from tests.integration.test_k8s_agent import Agent, _create_cache, _nodecache

pytestmark = pytest.mark.kubernetes

NS = "k8s-watch"
NODE = "watch-a"
MDC = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/modeldatacaches"
SIZE = 1_000_000


class SlowResyncAgent(Agent):
    """An agent that resyncs only every 30 s, its settings in this module's namespace."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--resync", "30", "--namespace", NS]


@dataclass
class World:
    kube: KubeCluster
    url: str
    revision: str
    digest: str
    agent: SlowResyncAgent


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's namespace and node, a 1 MB model behind nginx, and the agent."""
    base = tmp_path_factory.mktemp("k8s-watch")
    generate_model(base / "origin" / "w", SIZE, shards=1, seed=17)
    write_http_manifest(base / "origin" / "w")
    with (
        kube_share(kube_session, namespaces=[NS], nodes={NODE: {}}) as kube,
        nginx_origin(base / "origin") as origin,
    ):
        url = origin.url("w/preheat-manifest.json")
        revision, manifest = NodeStore(base / "probe").resolve(url)
        agent = SlowResyncAgent(NODE, base / "store", kube.kubeconfig, base / "agent.log")
        try:
            agent.start()
            yield World(kube, url, revision, manifest.digest, agent)
        finally:
            agent.stop()


def _held(world: World) -> list[str]:
    status = _nodecache(world.kube, NODE).get("status") or {}
    return [r["revision"] for r in status.get("revisions") or () if r["state"] == "Ready"]


def _evict_all(store: Path) -> str:
    """``preheat cache evict`` on the agent's store (another process), freeing everything."""
    exe = Path(sys.executable).parent / "preheat"
    argv = [str(exe), "cache", "evict", "--store", str(store), "--free", "1TB"]
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


def test_a_copy_evicted_behind_the_agents_back_leaves_its_nodecache_within_seconds(
    world: World,
) -> None:
    """Held, then no longer wanted (the cache deleted: the agent keeps the copy and lists
    it), the copy is evicted by ``preheat cache evict``: the NodeCache lists no revision
    and the Node label goes within 10 s (0.4-0.55 s measured); before, both stayed until the next resync (30 s
    here)."""
    kube, agent = world.kube, world.agent
    _create_cache(kube, "w", world.url, world.revision, [NODE], namespace=NS)
    until("held", lambda: world.revision in _held(world), timeout=60)
    kube.rest().must("DELETE", f"{MDC}/w")
    # The reconcile the deletion woke has run: the copy is still listed, no longer wanted.
    passes = agent.metric("preheat_agent_reconciles_total")
    until("a reconcile after the deletion",
          lambda: agent.metric("preheat_agent_reconciles_total") > passes, timeout=10)  # fmt: skip
    assert _held(world) == [world.revision]
    out = _evict_all(agent.store)
    evicted = time.monotonic()
    assert f"evict snapshot {world.digest}" in out, out
    until("the NodeCache drops the copy", lambda: not _held(world), timeout=10.0, interval=0.05)
    took = time.monotonic() - evicted
    status = _nodecache(kube, NODE)["status"]
    assert status["revisionCount"] == 0 and status["usedBytes"] == 0, status
    labels = kube.rest().get(f"/api/v1/nodes/{NODE}")["metadata"].get("labels") or {}
    assert revision_label(world.digest) not in labels
    assert took < 10.0  # 0.4-0.55 s here; a third of the 30 s resync leaves CI room
    print(f"NodeCache dropped the evicted copy {took:.2f} s after the eviction")


def test_a_wanted_copy_evicted_behind_the_agents_back_is_warmed_again_within_seconds(
    world: World,
) -> None:
    """A copy that a cache still wants, evicted by ``preheat cache evict``, is filled
    again within 10 s (the agent's warm-up sees it gone), not at the next resync."""
    kube, agent = world.kube, world.agent
    assert not _held(world)  # the first test's eviction was seen (or this runs alone)
    _create_cache(kube, "w2", world.url, world.revision, [NODE], namespace=NS)
    until("held", lambda: world.revision in _held(world), timeout=60)
    fetched = agent.metric("preheat_agent_bytes_fetched_total")
    _evict_all(agent.store)
    until("filled again",
          lambda: agent.metric("preheat_agent_bytes_fetched_total") > fetched,
          timeout=10.0)  # fmt: skip
    until("held again", lambda: world.revision in _held(world), timeout=10.0)
    kube.rest().must("DELETE", f"{MDC}/w2")
