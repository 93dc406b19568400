"""A pinned model rolled to a new revision on nodes whose stores hold one copy, on a real
v1.20.2 control plane (the operator, one agent per node, kubelet stand-ins).

Three nodes (pool=pin), each agent's store with room for one 1 MB model (capacity
1.5 MB), ``pin: true``, one replica (each pod asks 3 of a node's 4 CPUs, so surge puts
the new pod on another node). A new revision does not fit beside the pinned old copy on
any node, so its warm-ups fail for room (``NoRoom`` in the NodeCache). What is checked:
the operator takes the idle nodes out of the old cache's targets (``spec.nodes.exclude``,
``control.plan`` step 6), their agents unpin and evict the old copy, the new revision
warms there, the gate opens without waiting for its timeout, the pod rolls onto a warm
node, and at the end every node holds only the new revision, pinned. The old operator
kept the old cache on every node until the rollout finished, and the gate waited for
its timeout (300 s here).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from preheat.bench.models import generate_model, write_http_manifest
from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.resources import PodOverrides, endpoint_object
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import nginx_origin
from preheat.testing.procs import Process, free_port
from tests.integration.test_k8s_operator import apply_rbac

pytestmark = pytest.mark.kubernetes

NS = "k8s-pinned"
NODES = ("pin-a", "pin-b", "pin-c")
API = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}"
NC = "/apis/preheat.dev/v1alpha1/nodecaches"
MODEL_BYTES = 1_000_000


@dataclass
class World:
    kube: KubeCluster
    base: Path
    models: dict[str, tuple[str, str]]  # name -> (url, revision)
    procs: list[Process] = field(default_factory=list)

    def get(self, path: str) -> Any:
        return self.kube.rest().get(path)

    def pods(self) -> list[dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=preheat.dev/endpoint%3Dchat")
        return [p for p in items["items"] if not p["metadata"].get("deletionTimestamp")]

    def ready_pods(self) -> list[dict[str, Any]]:
        def ready(p: dict[str, Any]) -> bool:
            conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions") or ()}
            return conds.get("Ready") == "True"

        return [p for p in self.pods() if ready(p)]

    def held(self, node: str) -> dict[str, dict[str, Any]]:
        """revision -> its NodeCache row, for the node's Ready revisions."""
        status = (self.get(f"{NC}/{node}").get("status")) or {}
        return {r["revision"]: r for r in status.get("revisions") or () if r["state"] == "Ready"}

    def caches(self) -> dict[str, dict[str, Any]]:
        return {c["spec"]["revision"]: c for c in self.get(f"{API}/modeldatacaches")["items"]}

    def stable(self) -> str:
        variants = (self.get(f"{API}/inferenceendpoints/chat").get("status") or {}).get(
            "variants"
        ) or [{}]
        return str(variants[0].get("stable") or "")

    def events(self, reason: str) -> list[dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{NS}/events")["items"]
        return [e for e in items if e.get("reason") == reason]


def _preheat() -> str:
    return str(Path(sys.executable).parent / "preheat")


def _endpoint(world: World, model: str) -> dict[str, Any]:
    spec = parse_endpoint(
        {
            "name": "chat",
            "model": {"source": world.models[model][0]},
            "engine": {"simulated": {"profile": "tiny", "time_scale": 0.05}},
            "replicas": {"min": 1, "max": 2},
            "modelCacheConfig": {
                "weights": {
                    "enabled": True,
                    "nodes": {"selector": {"pool": "pin"}},
                    "pin": True,
                    "timeoutSeconds": 300,
                }
            },
        },
        origin="test",
    )
    pod = PodOverrides(resources={"requests": {"cpu": "3"}})
    return endpoint_object(spec, namespace=NS, pod=pod)


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's share of the session cluster, two models behind nginx, an agent per
    node with room for one model, and the operator (processes stopped by PID)."""
    base = tmp_path_factory.mktemp("k8s-pinned")
    for name, seed in (("v1", 31), ("v2", 32)):
        generate_model(base / "origin" / name, MODEL_BYTES, shards=1, seed=seed)
        write_http_manifest(base / "origin" / name)
    with (
        nginx_origin(base / "origin") as nginx,
        kube_share(kube_session, namespaces=[NS]) as kube,
    ):
        models = {}
        for name in ("v1", "v2"):
            url = nginx.url(f"{name}/preheat-manifest.json")
            models[name] = (url, NodeStore(base / "probe").resolve(url)[0])
        world = World(kube, base, models)
        try:
            _start(world)
            yield world
        finally:
            stops = [threading.Thread(target=p.stop, args=(10,)) for p in world.procs]
            for t in stops:
                t.start()
            for t in stops:
                t.join()


def _start(world: World) -> None:
    kube, base = world.kube, world.base
    for name in NODES:
        kube.add_node(name, labels={"pool": "pin"}, cpu="4")
    apply_rbac(kube, world.models["v1"][0], NS)
    agent_conf = kube.sa_kubeconfig(base / "agent.kubeconfig", "preheat-system", "preheat-agent")
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    for name in NODES:
        store = kube.root / "nodes" / name / "var/lib/preheat/store"
        world.procs.append(start_process(
            [_preheat(), "agent", "--node", name, "--store", str(store), "--kubeconfig",
             str(agent_conf), "--metrics-port", str(free_port()), "--resync", "1",
             "--backoff", "0.3", "--capacity", "1500000"],
            base / f"agent-{name}.log", env=env, inherit_env=False,
        ))  # fmt: skip
    op_conf = kube.sa_kubeconfig(base / "operator.kubeconfig", "preheat-system", "preheat-operator")
    world.procs.append(start_process(
        [_preheat(), "operator", "--kubeconfig", str(op_conf), "--namespace", NS,
         "--metrics-port", str(free_port()), "--rollout-deadline", "60", "--tick", "1"],
        base / "operator.log", env=env, inherit_env=False,
    ))  # fmt: skip


def test_a_pinned_old_revision_yields_its_room_and_the_rollout_finishes(world: World) -> None:
    """v1 pinned on the three nodes, one pod; v2 applied: the idle nodes are released from
    the v1 cache and warm v2, the pod rolls onto one of them well before the gate's
    timeout, v1's cache goes, and each node ends with v2 alone, pinned (module doc)."""
    _, v1 = world.models["v1"]
    _, v2 = world.models["v2"]
    world.kube.rest().must("POST", f"{API}/inferenceendpoints", _endpoint(world, "v1"))
    until("v1 pinned on every node", lambda: all(
        world.held(n).get(v1, {}).get("pinned") for n in NODES), 60)  # fmt: skip
    until("v1 deployed", lambda: world.stable().startswith(v1) and world.ready_pods(), 60)
    (old_pod,) = world.ready_pods()
    serving = old_pod["spec"]["nodeName"]

    world.kube.rest().must(
        "PATCH", f"{API}/inferenceendpoints/chat", {"spec": _endpoint(world, "v2")["spec"]},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    # The idle nodes give up the old copy and warm the new one; the serving node keeps it.
    idle = [n for n in NODES if n != serving]
    until("v2 on the idle nodes", lambda: all(v2 in world.held(n) for n in idle), 60)
    old_cache = world.caches().get(v1)
    if old_cache is not None:  # gone already if the rollout finished meanwhile
        assert set(old_cache["spec"]["nodes"].get("exclude") or ()) <= set(idle), old_cache
    # The rollout finishes well before the gate's 300 s timeout, onto a warm node.
    until("v2 deployed", lambda: world.stable().startswith(v2), 90)
    (new_pod,) = until(
        "one v2 pod Ready",
        lambda: [
            p
            for p in world.ready_pods()
            if p["metadata"]["annotations"]["preheat.dev/revision"] == v2
        ],
        30,
    )
    assert new_pod["spec"]["nodeName"] in idle, new_pod["spec"]["nodeName"]
    # Once no pod runs v1 its cache goes, the serving node's copy with it, and every node
    # ends with v2 alone, pinned.
    until("the v1 cache deleted", lambda: v1 not in world.caches(), 60)
    until("every node holds v2 alone, pinned", lambda: all(
        list(world.held(n)) == [v2] and world.held(n)[v2].get("pinned") for n in NODES), 60)  # fmt: skip
    released = [str(e.get("message")) for e in world.events("CacheReleased")]
    assert released and all(f"no longer kept on {n}" in " ".join(released) for n in idle), released
    assert not world.events("CacheGateTimedOut")
