"""The operator's executor against a real v1.20.2 API server, with no kubelet.

Node objects are written through the API (no kubelet stand-in, no node agent: no cache
ever fills), the ReplicaSet controller creates pods the scheduler cannot place, and the
executor (``KubeExecutor`` under the shared ``ReconcileLoop``, exactly what ``preheat
operator`` runs per endpoint) is driven pass by pass. Covers what the end-to-end module
does not: a replica count someone else set (an HPA, the scale subresource), the cache
gate's timeout, a restarted operator, a NotReady (not deleted) Node, the rendered HPA and
the shared ``ModelImageCache`` objects.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes import config as kube_config

from preheat.bench.models import generate_model, write_http_manifest
from preheat.control.spec import parse_endpoint
from preheat.runtime.fleetlog import FleetLog
from preheat.runtime.kubernetes.image_caches import sync_image_caches
from preheat.runtime.kubernetes.k8s_executor import KubeExecutor
from preheat.runtime.kubernetes.render import endpoint_manifests
from preheat.runtime.kubernetes.resources import endpoint_object
from preheat.runtime.kubernetes.workload import REVISION_ANNOTATION
from preheat.runtime.procs import start_process
from preheat.runtime.reconcile import ReconcileLoop
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.origins import nginx_origin
from preheat.testing.procs import free_port

pytestmark = pytest.mark.kubernetes

NS = "k8s-gaps"
API = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}"
APPS = f"/apis/apps/v1/namespaces/{NS}"
_RVK = "/apis/preheat.dev/v1alpha1/revocations"


@dataclass
class World:
    kube: KubeCluster
    source: str
    api: client.ApiClient
    origin_dir: Path
    origin_url: Any
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def executor(self, name: str) -> tuple[KubeExecutor, ReconcileLoop]:
        """A fresh executor and loop for one endpoint (a freshly started operator)."""

        def emit(body: dict[str, Any], kind: str, reason: str, message: str) -> None:
            self.events.append((body["metadata"]["name"], reason, message))

        executor = KubeExecutor(self.api, NS, name, emit=emit)
        return executor, ReconcileLoop(executor, FleetLog(None))

    def apply_endpoint(
        self,
        name: str,
        replicas: int,
        fallback: tuple[str, ...] = (),
        source: str | None = None,
        **cache: Any,
    ) -> None:
        doc: dict[str, Any] = {
            "name": name,
            "model": {
                "source": source or self.source,
                "fallback": [{"source": f} for f in fallback],
            },
            "engine": {"simulated": {"profile": "tiny"}},
            "replicas": {"min": replicas, "max": 8},
        }
        if cache:
            doc["modelCacheConfig"] = {"weights": cache}
        body = endpoint_object(parse_endpoint(doc, origin="test"), namespace=NS)
        self.kube.rest().must("POST", f"{API}/inferenceendpoints", body)

    def get(self, path: str) -> Any:
        return self.kube.rest().get(path)

    def revoke(self, name: str, key: str, loops: Any) -> None:
        """Create the Revocation ``name`` of ``key``, forget the Events so far, and run
        3 passes of each of ``loops`` (name -> (executor, loop)), none failing."""
        self.kube.rest().must("POST", _RVK, {
            "apiVersion": "preheat.dev/v1alpha1", "kind": "Revocation",
            "metadata": {"name": name}, "spec": {"key": key, "reason": name},
        })  # fmt: skip
        self.events.clear()
        for _, loop in loops.values():
            _passes(loop, 3)
            assert loop.log.errors == 0, list(loop.log.messages)

    def revision(self, name: str) -> str:
        """The revision the endpoint's Deployment (variant ``main``) runs."""
        dep = self.get(f"{APPS}/deployments/{name}-main")
        return str(dep["spec"]["template"]["metadata"]["annotations"][REVISION_ANNOTATION])

    def items(self, path: str) -> list[dict[str, Any]]:
        return list(self.get(path)["items"])

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        ep = self.get(f"{API}/inferenceendpoints/{name}")
        for c in (ep.get("status") or {}).get("conditions") or ():
            if c["type"] == kind:
                return dict(c)
        return {}


def _passes(loop: ReconcileLoop, n: int) -> None:
    async def run() -> None:
        for _ in range(n):
            await loop.once()

    asyncio.run(run())


def _node(name: str, labels: dict[str, str]) -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test",
             "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"conditions": [ready], "capacity": {"cpu": "4", "pods": "10"}},
    }


NODES = ("gap-a", "gap-b")
_LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


def _renew_leases(kube: KubeCluster, stop: threading.Event) -> None:
    """What a kubelet does for its Node (this module's Nodes have none): renew the Lease in
    kube-node-lease every 5 s, so the real node-lifecycle controller does not turn the
    Nodes Unknown 40 s after they were written (the revocation tests then saw both nodes
    down and an endpoint Degraded Unschedulable). Ends with the module, within 5 s."""
    while True:
        for name in NODES:
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}
            status, _ = kube.rest().call(
                "PATCH", f"{_LEASES}/{name}", {"spec": spec},
                content_type="application/merge-patch+json",
            )  # fmt: skip
            if status == 404:
                kube.rest().call("POST", _LEASES, {"metadata": {"name": name}, "spec": spec})
        if stop.wait(5.0):
            return


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's share of the session cluster (namespace k8s-gaps), two Node objects
    without a kubelet, and an HTTP model origin."""
    base: Path = tmp_path_factory.mktemp("k8s-gaps")
    generate_model(base / "origin" / "m", 200_000, shards=1, seed=3)
    write_http_manifest(base / "origin" / "m")
    with (
        nginx_origin(base / "origin") as nginx,
        kube_share(kube_session, namespaces=[NS]) as kube,
    ):
        for name in NODES:
            kube.rest().must("POST", "/api/v1/nodes", _node(name, {"pool": "gpu"}))
        stop = threading.Event()
        heartbeat = threading.Thread(target=_renew_leases, args=(kube, stop), daemon=True)
        heartbeat.start()
        api = kube_config.new_client_from_config(str(kube.kubeconfig))
        try:
            yield World(kube, nginx.url("m/preheat-manifest.json"), api, base / "origin", nginx.url)
        finally:
            api.close()
            stop.set()
            heartbeat.join(timeout=30)


@pytest.fixture(autouse=True)
def ready_nodes(world: World) -> None:
    """Each test starts with both Nodes Ready (a test may have turned one Unknown)."""
    for name in NODES:  # a strategic merge: conditions merge by type, no resourceVersion
        world.kube.rest().must(
            "PATCH", f"/api/v1/nodes/{name}/status",
            {"status": {"conditions": _node(name, {})["status"]["conditions"]}},
            content_type="application/strategic-merge-patch+json",
        )  # fmt: skip


def test_a_replica_count_set_through_the_scale_subresource_is_not_reset(world: World) -> None:
    """After `kubectl scale` (what an HPA does) the operator keeps the new count over
    later passes, and applies the spec's own count again only when that count changes."""
    world.apply_endpoint("scaled", 2)
    _, loop = world.executor("scaled")
    _passes(loop, 2)
    dep = world.get(f"{APPS}/deployments/scaled-main")
    assert dep["spec"]["replicas"] == 2
    world.kube.rest().must(
        "PATCH", f"{APPS}/deployments/scaled-main/scale", {"spec": {"replicas": 4}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    _passes(loop, 3)
    assert world.get(f"{APPS}/deployments/scaled-main")["spec"]["replicas"] == 4
    variants = world.get(f"{API}/inferenceendpoints/scaled")["spec"]["variants"]
    variants[0]["replicas"]["min"] = 3
    world.kube.rest().must(
        "PATCH", f"{API}/inferenceendpoints/scaled", {"spec": {"variants": variants}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    _passes(loop, 2)
    assert world.get(f"{APPS}/deployments/scaled-main")["spec"]["replicas"] == 3


def test_the_gate_times_out_into_a_deployment_with_cache_ready_false(world: World) -> None:
    """No node ever warms: no Deployment while the gate waits; after timeoutSeconds the
    Deployment is created anyway and CacheReady=False says GateTimedOut."""
    world.apply_endpoint(
        "gated", 1, enabled=True, nodes={"selector": {"pool": "gpu"}}, minReady=1,
        timeoutSeconds=2,
    )  # fmt: skip
    _, loop = world.executor("gated")
    _passes(loop, 2)
    status, _ = world.kube.rest().call("GET", f"{APPS}/deployments/gated-main")
    assert status == 404
    waiting = world.condition("gated", "CacheReady")
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitingForNodes")
    time.sleep(2.5)
    _passes(loop, 2)
    assert world.get(f"{APPS}/deployments/gated-main")["spec"]["replicas"] == 1
    timed_out = world.condition("gated", "CacheReady")
    assert (timed_out["status"], timed_out["reason"]) == ("False", "GateTimedOut")
    assert any(r == "CacheGateTimedOut" for n, r, _ in world.events if n == "gated")


def test_a_restarted_operator_changes_nothing_and_creates_no_duplicates(world: World) -> None:
    """A fresh executor per endpoint (the operator restarted, memory only in status)
    re-creates nothing and writes nothing: the same objects (uids), no Deployment spec
    change (generation), Service and cache untouched, the status memory unchanged."""
    sel = "labelSelector=preheat.dev/endpoint%3Dgated"

    def snapshot() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path in (f"{APPS}/deployments", f"/api/v1/namespaces/{NS}/services",
                     f"{API}/modeldatacaches"):  # fmt: skip
            for o in world.items(f"{path}?{sel}"):
                meta = o["metadata"]
                # Controllers write a Deployment's status; only its spec is the operator's.
                mark = meta["generation"] if "deployments" in path else meta["resourceVersion"]
                out[f"{path}/{meta['name']}"] = (meta["uid"], mark)
        ep = world.get(f"{API}/inferenceendpoints/gated")
        out["memory"] = ep["status"]["variants"]
        return out

    before = snapshot()
    assert len(before) == 4  # one Deployment, one Service, one cache, the status memory
    world.events.clear()
    for _ in range(2):
        _, loop = world.executor("gated")
        _passes(loop, 3)
    assert snapshot() == before
    writes = [r for n, r, _ in world.events if r.endswith("Created") or r.startswith("Rollout")]
    assert writes == []


def test_a_not_ready_node_is_treated_as_lost(world: World) -> None:
    """A Node whose Ready condition turns Unknown (still present) is down for the planner."""
    executor, _ = world.executor("gated")
    for name, ready in (("gap-a", "True"), ("gap-b", "Unknown")):
        node = world.get(f"/api/v1/nodes/{name}")
        node["status"]["conditions"] = _node(name, {})["status"]["conditions"]
        node["status"]["conditions"][0]["status"] = ready
        world.kube.rest().must("PUT", f"/api/v1/nodes/{name}/status", node)

    async def observe() -> Any:
        return await executor.observe()

    observed = asyncio.run(observe())
    assert observed is not None
    up = {n.name: n.up for n in observed[1].nodes}
    assert up == {"gap-a": True, "gap-b": False}


def test_the_rendered_hpa_is_accepted_by_the_api_server(world: World) -> None:
    """`preheat k8s render`'s HPA for `autoscaling` passes server-side validation."""
    spec = parse_endpoint(
        {"name": "chat", "model": {"source": world.source}, "replicas": {"min": 1, "max": 4},
         "autoscaling": {"target_in_flight": 2.5, "scale_in_below": 1}},
        origin="test",
    )  # fmt: skip
    (hpa,) = [o for o in endpoint_manifests(spec, namespace=NS) if o["kind"].startswith("Horiz")]
    out = world.kube.rest().must(
        "POST", f"/apis/autoscaling/v2beta2/namespaces/{NS}/horizontalpodautoscalers?dryRun=All",
        hpa,
    )  # fmt: skip
    assert out["spec"]["metrics"][0]["external"]["target"]["averageValue"] == "2500m"


def test_image_caches_are_shared_per_image_and_go_with_their_last_endpoint(world: World) -> None:
    """With the image cache on, one ModelImageCache per image lists the endpoints that use
    it (no agent pulls here: the Deployment is not held for it); the last endpoint out
    deletes it."""
    for name in ("img-one", "img-two"):
        world.kube.rest().must("POST", f"{API}/inferenceendpoints", _image_endpoint(world, name))
    loops = {name: world.executor(name) for name in ("img-one", "img-two")}
    for _, loop in loops.values():
        _passes(loop, 2)
    assert world.get(f"{APPS}/deployments/img-one-main")["spec"]["replicas"] == 1
    (mic,) = world.items(f"{API}/modelimagecaches")
    assert mic["spec"]["image"] == "registry.test/engine:1"
    assert mic["spec"]["endpoints"] == ["img-one", "img-two"]
    assert mic["spec"]["nodes"] == {"selector": {"pool": "gpu"}}
    world.kube.rest().must(
        "PATCH", f"{API}/inferenceendpoints/img-one",
        {"spec": {"modelCacheConfig": {"image": {"enabled": False}}}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    _passes(loops["img-one"][1], 1)
    (mic,) = world.items(f"{API}/modelimagecaches")
    assert mic["spec"]["endpoints"] == ["img-two"]
    executor = loops["img-two"][0]
    asyncio.run(sync_image_caches(executor.custom, NS, "img-two", None))  # endpoint deleted
    assert world.items(f"{API}/modelimagecaches") == []


def _image_endpoint(world: World, name: str) -> dict[str, Any]:
    spec = parse_endpoint(
        {"name": name, "model": {"source": world.source}, "image": "registry.test/engine:1",
         "engine": {"simulated": {"profile": "tiny"}},
         "modelCacheConfig": {"image": {"enabled": True},
                              "weights": {"enabled": False, "nodes": {"selector": {"pool": "gpu"}}}}},
        origin="test",
    )  # fmt: skip
    return endpoint_object(spec, namespace=NS)


def _reconciles(port: int, endpoint: str) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("preheat_operator_reconciles_total{") and f'"{endpoint}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_killed_and_restarted_operator_process_carries_on_without_duplicates(
    world: World, tmp_path: Path
) -> None:
    """`preheat operator` SIGKILLed while a gate waits, then restarted: the same single
    cache (uid), still no Deployment, and the gate's wait keeps its start time."""
    world.apply_endpoint(
        "restart", 1, enabled=True, nodes={"selector": {"pool": "gpu"}}, minReady=1,
        timeoutSeconds=600,
    )  # fmt: skip
    sel = "labelSelector=preheat.dev/endpoint%3Drestart"
    port = free_port()
    argv = [str(Path(sys.executable).parent / "preheat"), "operator", "--kubeconfig",
            str(world.kube.kubeconfig), "--namespace", NS, "--metrics-port", str(port),
            "--tick", "1"]  # fmt: skip

    def variant() -> dict[str, Any]:
        ep = world.get(f"{API}/inferenceendpoints/restart")
        return dict(((ep.get("status") or {}).get("variants") or [{}])[0])

    op = start_process(argv, tmp_path / "operator-1.log")
    try:
        world.kube.wait_for("a cache and a waiting gate", lambda: (
            world.items(f"{API}/modeldatacaches?{sel}") and variant().get("gateSince")
        ), timeout=60)  # fmt: skip
    finally:
        op.stop(5, sig=signal.SIGKILL)
    (cache,) = world.items(f"{API}/modeldatacaches?{sel}")
    since = variant()["gateSince"]
    op = start_process(argv, tmp_path / "operator-2.log")
    try:
        world.kube.wait_for("3 passes after the restart", lambda: _reconciles(port, "restart") >= 3,
                            timeout=60)  # fmt: skip
    finally:
        op.stop(10)
    assert [c["metadata"]["uid"] for c in world.items(f"{API}/modeldatacaches?{sel}")] == [
        cache["metadata"]["uid"]
    ]
    assert world.items(f"{APPS}/deployments?{sel}") == []
    assert variant()["gateSince"] == since


def test_a_revoked_revision_rolls_to_the_fallback_or_degrades(world: World) -> None:
    """A Revocation of the endpoints' revision: the one with a model.fallback gets its
    Deployment rolled to the fallback revision (Progressing RollingToFallback, a Revoked
    Event); the one without keeps its Deployment and reports Degraded=True Revoked.
    Deleting the Revocation rolls the first back."""
    generate_model(world.origin_dir / "m0", 150_000, shards=1, seed=9)
    write_http_manifest(world.origin_dir / "m0")
    fb = world.origin_url("m0/preheat-manifest.json")
    world.apply_endpoint("fb", 1, fallback=(fb,))
    world.apply_endpoint("nofb", 1)
    loops = {n: world.executor(n) for n in ("fb", "nofb")}
    for _, loop in loops.values():
        _passes(loop, 2)

    r1 = world.revision("fb")
    assert world.revision("nofb") == r1
    world.revoke("withdrawn", r1, loops)
    r0 = world.revision("fb")
    assert r0 != r1 and loops["fb"][0].fallbacks["main"][0].revision == r0
    prog = world.condition("fb", "Progressing")
    assert (prog["status"], prog["reason"]) == ("True", "RollingToFallback"), prog
    assert world.revision("nofb") == r1
    deg = world.condition("nofb", "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "Revoked") and "fallback" in deg["message"]
    revoked = [(n, m) for n, r, m in world.events if r == "Revoked"]
    assert {n for n, _ in revoked} == {"fb", "nofb"} and len(revoked) == 2  # once each
    world.kube.rest().must("DELETE", f"{_RVK}/withdrawn")
    for _, loop in loops.values():
        _passes(loop, 2)
    assert world.revision("fb") == r1
    deg = world.condition("nofb", "Degraded")
    assert deg["status"] == "False", deg


# --- imgrevoke (issue 11): a revoked image digest --------------------------------------


def test_a_revoked_image_rolls_to_the_image_fallback_or_degrades(world: World) -> None:
    """A Revocation of the image digest two endpoints run: the one with an image.fallback
    gets its Deployment's image moved to the fallback (Progressing RollingToFallback, a
    Revoked Event); the one without keeps its Deployment and reports Degraded=True Revoked
    naming image.fallback. Deleting the Revocation moves the first back."""
    repo = "127.0.0.1:5999/team/engine"
    digest, fb_digest = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    image, fallback = f"{repo}@{digest}", f"{repo}@{fb_digest}"
    for name, img in (("imgfb", {"ref": image, "fallback": [fallback]}), ("imgnofb", image)):
        doc = {
            "name": name,
            "model": {"source": world.source},
            "image": img,
            "engine": {"simulated": {"profile": "tiny"}},
            "replicas": {"min": 1, "max": 2},
        }
        body = endpoint_object(parse_endpoint(doc, origin="test"), namespace=NS)
        world.kube.rest().must("POST", f"{API}/inferenceendpoints", body)
    loops = {n: world.executor(n) for n in ("imgfb", "imgnofb")}
    for _, loop in loops.values():
        _passes(loop, 2)

    def images(name: str) -> set[str]:
        dep = world.get(f"{APPS}/deployments/{name}-main")
        return {c["image"] for c in dep["spec"]["template"]["spec"]["containers"]}

    assert image in images("imgfb") and image in images("imgnofb")
    rvk = "/apis/preheat.dev/v1alpha1/revocations"
    world.kube.rest().must("POST", rvk, {
        "apiVersion": "preheat.dev/v1alpha1", "kind": "Revocation",
        "metadata": {"name": "base-layer-cve"}, "spec": {"key": digest, "reason": "CVE"},
    })  # fmt: skip
    world.events.clear()
    for _, loop in loops.values():
        _passes(loop, 3)
        assert loop.log.errors == 0, list(loop.log.messages)
    assert fallback in images("imgfb") and image not in images("imgfb")
    prog = world.condition("imgfb", "Progressing")
    assert (prog["status"], prog["reason"]) == ("True", "RollingToFallback"), prog
    assert image in images("imgnofb")
    deg = world.condition("imgnofb", "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "Revoked"), deg
    assert "image.fallback" in deg["message"]
    revoked = [(n, m) for n, r, m in world.events if r == "Revoked"]
    assert {n for n, _ in revoked} == {"imgfb", "imgnofb"} and len(revoked) == 2  # once each
    world.kube.rest().must("DELETE", f"{rvk}/base-layer-cve")
    deadline = time.monotonic() + 30  # the roll back is a surge rollout: passes until done
    while True:
        for _, loop in loops.values():
            _passes(loop, 2)
        if image in images("imgfb") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert image in images("imgfb") and fallback not in images("imgfb")
    deg = world.condition("imgnofb", "Degraded")
    assert deg["status"] == "False", deg


# --- revoke (issue 11): a revoked tar layer of an oci:// revision ----------------------


def test_a_revoked_tar_layer_rolls_the_revisions_built_from_it(
    world: World, tmp_path: Path
) -> None:
    """A Revocation of one tar layer (a shared tokenizer) of an oci:// revision: the
    endpoint with a model.fallback not built from it rolls its Deployment to the fallback
    (Progressing RollingToFallback); the one without reports Degraded=True Revoked; one
    Revoked Event each. The operator learns the layers from the revision's manifest."""
    from preheat.testing.registry import ModelLayer, registry, tar_layer

    tar = "application/vnd.cncf.model.weight.v1.tar"
    shared = tar_layer([("tokenizer.json", b'{"v": 1}')])
    layer = "sha256:" + hashlib.sha256(shared).hexdigest()
    with registry(tmp_path / "registry") as reg:
        reg.push_model_layers("models/m:v1", [
            ModelLayer(tar, shared), ModelLayer(tar, tar_layer([("w.bin", b"1" * 4096)])),
        ])  # fmt: skip
        reg.push_model_layers("models/m:v0", [ModelLayer(tar, tar_layer([("w.bin", b"0" * 4096)]))])
        v1_ref, v0_ref = f"oci://{reg.ref('models/m:v1')}", f"oci://{reg.ref('models/m:v0')}"
        world.apply_endpoint("layerfb", 1, fallback=(v0_ref,), source=v1_ref)
        world.apply_endpoint("layernofb", 1, source=v1_ref)
        loops = {n: world.executor(n) for n in ("layerfb", "layernofb")}
        for _, loop in loops.values():
            _passes(loop, 2)

        v1 = world.revision("layerfb")
        assert world.revision("layernofb") == v1 and v1 != layer
        try:
            world.revoke("tokenizer-cve", layer, loops)
        finally:
            world.kube.rest().must("DELETE", f"{_RVK}/tokenizer-cve")
    v0 = world.revision("layerfb")
    assert v0 not in (v1, layer) and loops["layerfb"][0].fallbacks["main"][0].revision == v0
    prog = world.condition("layerfb", "Progressing")
    assert (prog["status"], prog["reason"]) == ("True", "RollingToFallback"), prog
    assert world.revision("layernofb") == v1
    deg = world.condition("layernofb", "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "Revoked") and "fallback" in deg["message"]
    revoked = [n for n, r, _ in world.events if r == "Revoked"]
    assert sorted(revoked) == ["layerfb", "layernofb"]  # once each
