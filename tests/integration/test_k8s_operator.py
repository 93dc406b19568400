"""`preheat operator` end to end on a real v1.20.2 control plane.

Three stand-in nodes (op-a and op-b labelled pool=gpu: the cache targets; op-c
cold), one `preheat agent` process per node on that node's hostPath store, the operator
as a real process authenticated as the rendered `preheat-operator` ServiceAccount (so
RBAC is the rendered ClusterRole), the router as `preheat-router-chat`. Each engine pod
requests 3 of a node's 4 CPUs, so the real scheduler puts one pod per node. The origin is
nginx behind a byte-counting proxy: every byte any node or pod fetched is counted at the
origin. Objects are checked through the API, as a user would with kubectl.

The tests run in order and share the cluster: first deploy (gated), scale-out past the
warm nodes (cold fallback), routing, version change under load, a failed rollout rolled
back, node loss and recovery, endpoint deletion.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from preheat.bench.models import generate_model, write_http_manifest
from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.nodecache_status import revision_label
from preheat.runtime.kubernetes.render import endpoint_manifests, system_manifests
from preheat.runtime.kubernetes.resources import PodOverrides, endpoint_object
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import AppInThread, nginx_origin
from preheat.testing.procs import Process, free_port

pytestmark = pytest.mark.kubernetes

NS = "k8s-operator"
NODES = {"op-a": {"pool": "gpu"}, "op-b": {"pool": "gpu"}, "op-c": {}}
API = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}"
MODEL_BYTES = 2_000_000
TOKEN = "operator-test-admin-token"


class CountingOrigin:
    """A proxy in front of nginx that counts the body bytes it served (the origin's
    egress), with Range requests passed through."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.bytes = 0
        self.lock = threading.Lock()
        self.app = AppInThread(self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("range", "if-none-match", "if-match", "if-range")
        }
        async with (
            aiohttp.ClientSession() as s,
            s.request(request.method, self.upstream + request.path_qs, headers=headers) as r,
        ):
            body = await r.read()
            keep = {
                k: v
                for k, v in r.headers.items()
                if k.lower()
                in ("content-range", "etag", "last-modified", "accept-ranges", "content-type")
            }
            with self.lock:
                self.bytes += len(body)
            return web.Response(status=r.status, body=body, headers=keep)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.app.port}/{path}"


@dataclass
class World:
    kube: KubeCluster
    origin: CountingOrigin
    models: dict[str, tuple[str, str, str]]  # name -> (url, revision, manifest digest)
    base: Path
    agents: dict[str, Process] = field(default_factory=dict)
    operator: Process | None = None
    operator_port: int = 0
    router_port: int = 0
    numbers: dict[str, Any] = field(default_factory=dict)

    def get(self, path: str) -> Any:
        return self.kube.rest().get(path)

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.kube.rest().call(method, path, body, **kw)

    def endpoint(self) -> dict[str, Any]:
        return dict(self.get(f"{API}/inferenceendpoints/chat"))

    def condition(self, obj: dict[str, Any], kind: str) -> dict[str, Any]:
        for c in (obj.get("status") or {}).get("conditions") or ():
            if c["type"] == kind:
                return dict(c)
        return {}

    def pods(self) -> list[dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=preheat.dev/endpoint%3Dchat")[
            "items"
        ]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def ready_pods(self) -> list[dict[str, Any]]:
        def ready(p: dict[str, Any]) -> bool:
            conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions") or ()}
            return conds.get("Ready") == "True"

        return [p for p in self.pods() if ready(p)]

    def patch_endpoint(self, patch: dict[str, Any]) -> None:
        self.kube.rest().must(
            "PATCH", f"{API}/inferenceendpoints/chat", patch,
            content_type="application/merge-patch+json",
        )  # fmt: skip

    def events(self, reason: str) -> list[dict[str, Any]]:
        items = self.get(f"/api/v1/namespaces/{NS}/events")["items"]
        return [e for e in items if e.get("reason") == reason]

    def complete(self, prompt: str) -> tuple[int, str]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.router_port}/v1/completions",
            data=json.dumps({"model": "chat", "prompt": prompt, "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=15) as r:
                r.read()
                return r.status, r.headers.get("X-Preheat-Instance", "")
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read().decode(errors="replace")[:200]
        except OSError as exc:
            return 0, str(exc)


def _preheat() -> str:
    return str(Path(sys.executable).parent / "preheat")


def _endpoint_body(world: World, model: str, replicas: int, **extra: Any) -> dict[str, Any]:
    url = world.models[model][0]
    spec = parse_endpoint(
        {
            "name": "chat",
            "model": {"source": url},
            "engine": {"simulated": {"profile": "tiny", "time_scale": 0.05}},
            "replicas": {"min": replicas, "max": 8},
            "routing": {"strategy": "prefix_aware"},
            "modelCacheConfig": {
                "weights": {
                    "enabled": True,
                    "nodes": {"selector": {"pool": "gpu"}},
                    "minReady": 2,
                    "timeoutSeconds": 120,
                    **extra,
                }
            },
        },
        origin="test",
    )
    pod = PodOverrides(resources={"requests": {"cpu": "3"}})
    return endpoint_object(spec, namespace=NS, pod=pod)


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's share of the session cluster (namespace k8s-operator), origin,
    agents, operator and router (processes stopped by PID, objects removed by the share)."""
    base = tmp_path_factory.mktemp("k8s-operator")
    for name, seed in (("v1", 11), ("v2", 12)):
        generate_model(base / "origin" / name, MODEL_BYTES, shards=2, seed=seed)
        write_http_manifest(base / "origin" / name)
    # 400 KB/s per connection: a fill takes a few seconds, so the gate is seen closed.
    with (
        nginx_origin(base / "origin", limit_rate=400_000) as nginx,
        kube_share(kube_session, namespaces=[NS]) as kube,
    ):
        counting = CountingOrigin(nginx.url(""))
        with counting.app:
            models = {}
            for name in ("v1", "v2"):
                url = counting.url(f"{name}/preheat-manifest.json")
                rev, manifest = NodeStore(base / "probe").resolve(url)
                models[name] = (url, rev, manifest.digest)
            counting.bytes = 0
            world = World(kube, counting, models, base)
            try:
                _start(world)
                yield world
            finally:
                # In parallel: each may take seconds to exit on a loaded machine.
                stops = [threading.Thread(target=p.stop, args=(10,))
                         for p in [world.operator, *world.agents.values()] if p is not None]  # fmt: skip
                for t in stops:
                    t.start()
                for t in stops:
                    t.join()
                if world.numbers:
                    print("\nk8s operator numbers:", json.dumps(world.numbers, indent=1))


def apply_rbac(kube: KubeCluster, source: str, namespace: str) -> None:
    """The rendered system RBAC (the settings Roles too: every agent reads
    preheat-settings, OriginOnly) and the endpoint ``chat``'s router RBAC in ``namespace``."""
    rbac = [
        m for m in system_manifests()
        if m["kind"] in {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
        or (m["kind"] in {"Role", "RoleBinding"} and m["metadata"]["namespace"] == "preheat-system")
    ]  # fmt: skip
    spec = parse_endpoint({"name": "chat", "model": {"source": source}}, origin="t")
    router_rbac = [
        o
        for o in endpoint_manifests(spec, namespace=namespace)
        if o["kind"] in {"ServiceAccount", "Role", "RoleBinding"}
    ]
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac + router_rbac))


def _start(world: World) -> None:
    kube, base = world.kube, world.base
    for name, labels in NODES.items():
        kube.add_node(name, labels=labels, cpu="4")
    apply_rbac(kube, world.models["v1"][0], NS)
    agent_conf = kube.sa_kubeconfig(base / "agent.kubeconfig", "preheat-system", "preheat-agent")
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    for name in NODES:
        store = kube.root / "nodes" / name / "var/lib/preheat/store"
        port = free_port()
        world.agents[name] = start_process(
            [_preheat(), "agent", "--node", name, "--store", str(store), "--kubeconfig",
             str(agent_conf), "--metrics-port", str(port), "--resync", "1", "--backoff", "0.3"],
            base / f"agent-{name}.log", env=env, inherit_env=False,
        )  # fmt: skip
    op_conf = kube.sa_kubeconfig(base / "operator.kubeconfig", "preheat-system", "preheat-operator")
    world.operator_port = free_port()
    world.operator = start_process(
        [_preheat(), "operator", "--kubeconfig", str(op_conf), "--namespace", NS,
         "--metrics-port", str(world.operator_port), "--rollout-deadline", "40", "--tick", "1"],
        base / "operator.log", env=env, inherit_env=False,
    )  # fmt: skip
    until("operator /metrics", lambda: _metrics(world), timeout=30)


def _metrics(world: World) -> str:
    assert world.operator is not None and world.operator.running, (
        world.base / "operator.log"
    ).read_text()[-3000:]
    with urllib.request.urlopen(f"http://127.0.0.1:{world.operator_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _start_router(world: World) -> None:
    conf = world.kube.sa_kubeconfig(world.base / "router.kubeconfig", NS, "preheat-router-chat")
    world.router_port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
        "PREHEAT_ADMIN_TOKEN": TOKEN,
        "PREHEAT_ROUTER_SALT": "a-salt-of-at-least-16-bytes",
    }
    world.agents["router"] = start_process(
        [_preheat(), "router", "serve", "--kubernetes", "--endpoint", "chat", "--namespace",
         NS, "--kubeconfig", str(conf), "--port", str(world.router_port),
         "--health-interval", "0.5"],
        world.base / "router.log", env=env, inherit_env=False,
    )  # fmt: skip


def _router_instances(world: World) -> dict[str, str]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{world.router_port}/admin/config",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        (main,) = json.loads(r.read())["variants"]
    return {i["url"]: i["state"] for i in main["instances"]}


def _pod_ready_seconds(pod: dict[str, Any]) -> float:
    created = pod["metadata"]["creationTimestamp"]
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    parse = lambda t: time.mktime(time.strptime(t, "%Y-%m-%dT%H:%M:%SZ"))  # noqa: E731
    return parse(ready["lastTransitionTime"]) - parse(created)


def test_first_deploy_waits_for_min_ready_nodes_then_lands_on_warm_nodes(world: World) -> None:
    """No Deployment exists until both target nodes hold the revision (Node labels,
    NodeCaches Ready, CacheReady=True), then both pods run on the warm nodes."""
    _url, rev, digest = world.models["v1"]
    t0 = time.monotonic()
    world.kube.rest().must("POST", f"{API}/inferenceendpoints", _endpoint_body(world, "v1", 2))
    cache = until("the ModelDataCache", lambda: world.get(f"{API}/modeldatacaches")["items"], 30)[0]
    assert cache["spec"]["revision"] == rev and cache["spec"]["nodes"] == {
        "selector": {"pool": "gpu"}
    }
    assert cache["metadata"]["ownerReferences"][0]["name"] == "chat"
    # The fill takes seconds (rate-limited origin): the gate is seen closed.
    gated = until(
        "CacheReady=False while the nodes fill",
        lambda: (
            world.condition(world.endpoint(), "CacheReady").get("reason") == "WaitingForNodes"
            and world.endpoint()
        ),
        30,
    )
    assert world.call("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/chat-main")[0] == 404
    assert world.condition(gated, "Ready")["status"] == "False"
    dep = until(
        "the Deployment",
        lambda: (
            world.call("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/chat-main")[1]
            if world.call("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/chat-main")[0] == 200
            else None
        ),
        60,
    )
    # When it appeared, both target nodes held the revision (the agents' labels and status).
    label = revision_label(digest)
    for node in ("op-a", "op-b"):
        assert world.get(f"/api/v1/nodes/{node}")["metadata"]["labels"].get(label) == "true"
    assert label not in world.get("/api/v1/nodes/op-c")["metadata"]["labels"]
    tpl = dep["spec"]["template"]
    assert tpl["metadata"]["annotations"]["preheat.dev/snapshot"] == digest
    pref = tpl["spec"]["affinity"]["nodeAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pref
    assert (
        pref["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"][
            "matchExpressions"
        ][0]["key"]
        == label
    )
    ep = until(
        "Ready=True",
        lambda: (
            world.condition(world.endpoint(), "Ready").get("status") == "True" and world.endpoint()
        ),
        90,
    )
    world.numbers["apply_to_ready_s"] = round(time.monotonic() - t0, 1)
    assert world.condition(ep, "CacheReady")["status"] == "True"
    assert ep["status"]["warmNodes"] == 2 and ep["status"]["readyReplicas"] == 2
    assert world.condition(ep, "Ready")["observedGeneration"] == ep["metadata"]["generation"]
    pods = world.ready_pods()
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["op-a", "op-b"]
    world.numbers["warm_pod_ready_s"] = [_pod_ready_seconds(p) for p in pods]
    mdc = world.get(f"{API}/modeldatacaches/{cache['metadata']['name']}")
    assert mdc["status"]["readyNodes"] == 2
    assert world.condition(mdc, "CacheReady")["status"] == "True"
    assert world.events("CacheReady") and world.events("DeploymentCreated")
    world.numbers["origin_bytes_after_first_deploy"] = world.origin.bytes
    # The two warm nodes fetched the model once each; the pods fetched nothing.
    assert world.origin.bytes <= 2 * MODEL_BYTES + 20_000
    out = world.kube.kubectl(
        "get", "-n", NS, "inferenceendpoints,modeldatacaches,nodecaches"
    ).stdout
    assert "chat" in out and "True" in out


def test_scale_out_past_warm_nodes_starts_a_cold_pod_from_the_origin(world: World) -> None:
    """A third replica lands on the cold op-c; its init container pulls from the origin
    (counted there) and it becomes Ready, more slowly than the warm ones."""
    before = world.origin.bytes
    world.patch_endpoint({"spec": _endpoint_body(world, "v1", 3)["spec"]})
    until("3 ready pods", lambda: len(world.ready_pods()) == 3 or None, 90)
    cold = [p for p in world.ready_pods() if p["spec"]["nodeName"] == "op-c"]
    assert len(cold) == 1
    fetched = world.origin.bytes - before
    assert MODEL_BYTES <= fetched <= MODEL_BYTES + 20_000
    world.numbers["cold_pod_origin_bytes"] = fetched
    world.numbers["cold_pod_ready_s"] = _pod_ready_seconds(cold[0])
    ep = until(
        "Ready=True at 3",
        lambda: (
            world.condition(world.endpoint(), "Ready").get("status") == "True" and world.endpoint()
        ),
        30,
    )
    assert ep["status"]["readyReplicas"] == 3
    # The operator's /metrics carries every pod start as local mode counts them: the warm
    # pods' weights were a cache hit, the cold pod's a miss.
    until(
        "start records on the operator's /metrics",
        lambda: (
            (
                'preheat_weights_cache_total{event_class="scale_out",result="miss"}'
                in _metrics(world)
                and 'result="hit"' in _metrics(world)
            )
            or None
        ),
        60,
    )


def _deployment(world: World) -> dict[str, Any]:
    return dict(world.get(f"/apis/apps/v1/namespaces/{NS}/deployments/chat-main"))


def _versions(pods: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["annotations"]["preheat.dev/version"] for p in pods}


def test_requests_through_the_router_reach_the_pods_with_prefix_aware_routing(world: World) -> None:
    """The router finds the pods through the variant Service's EndpointSlices, and one
    prompt keeps going to one pod (prefix-aware)."""
    _start_router(world)
    urls = {f"http://{p['status']['podIP']}:8000" for p in world.ready_pods()}
    until("the router lists the 3 pods", lambda: set(_router_instances(world)) == urls, 60)
    seen: dict[str, set[str]] = {}
    for i in range(12):
        prompt = f"prompt-{i % 3} " + "shared context " * 200
        status, instance = world.complete(prompt)
        assert status == 200, instance
        seen.setdefault(prompt[:9], set()).add(instance)
    assert all(len(v) == 1 for v in seen.values()), seen
    assert set().union(*seen.values()) <= urls


def test_version_change_warms_first_rolls_without_a_failed_request_then_drops_the_old_cache(
    world: World,
) -> None:
    """v1 -> v2 under a bounded load: the v2 cache is warmed before any v2 pod, the
    rollout surges, no request fails, and the v1 cache is deleted only afterwards."""
    _, v1, _ = world.models["v1"]
    _, v2, v2_digest = world.models["v2"]
    world.patch_endpoint({"spec": _endpoint_body(world, "v1", 2)["spec"]})
    until("2 pods", lambda: len(world.pods()) == 2 and len(world.ready_pods()) == 2, 60)
    results: list[int] = []
    stop = threading.Event()

    def load() -> None:
        for i in range(600):  # bounded in count and (below) in time
            if stop.is_set():
                return
            results.append(world.complete(f"load-{i % 5} " + "x " * 100)[0])

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        world.patch_endpoint({"spec": _endpoint_body(world, "v2", 2)["spec"]})

        def caches() -> set[str]:
            return {c["spec"]["revision"] for c in world.get(f"{API}/modeldatacaches")["items"]}

        until("the v2 cache", lambda: v2 in caches(), 30)
        # No v2 pod before the v2 gate opened: the Deployment still runs v1 while it fills.
        first = _deployment(world)["spec"]["template"]["metadata"]["annotations"]
        if world.condition(world.endpoint(), "CacheReady").get("status") == "False":
            assert first["preheat.dev/revision"] == v1
        until(
            "every pod runs v2 and Ready",
            lambda: (
                len(world.ready_pods()) == 2
                and len(world.pods()) == 2
                and {p["metadata"]["annotations"]["preheat.dev/revision"] for p in world.pods()}
                == {v2}
                and world.condition(world.endpoint(), "Ready").get("status") == "True"
            ),
            120,
        )
        until("the v1 cache is deleted", lambda: v1 not in caches(), 60)
    finally:
        stop.set()
        thread.join(30)
    assert results and all(s == 200 for s in results), sorted(set(results))
    world.numbers["rollout_requests"] = len(results)
    label = revision_label(v2_digest)
    assert all(
        world.get(f"/api/v1/nodes/{n}")["metadata"]["labels"].get(label) for n in ("op-a", "op-b")
    )
    assert world.events("RolloutFinished") and world.events("CacheDeleted")
    ep = world.endpoint()
    assert ep["status"]["variants"][0]["stable"].startswith(v2)


def test_a_rollout_that_never_becomes_ready_rolls_back_and_says_degraded(world: World) -> None:
    """An engine that cannot start crash-loops; the operator rolls the Deployment back to
    the stable version and sets Degraded=True (RolloutFailed)."""
    stable = world.endpoint()["status"]["variants"][0]["stable"]
    body = _endpoint_body(world, "v2", 2)["spec"]
    broken = {"command": "preheat engine serve --no-such-flag {snapshot} {port}"}
    for v in body["variants"]:
        v["engine"] = broken
    body["engine"] = {"simulated": None, **broken}  # merge patch: drop the old engine
    world.patch_endpoint({"spec": body})
    ep = until(
        "Degraded=True",
        lambda: (
            world.condition(world.endpoint(), "Degraded").get("status") == "True"
            and world.endpoint()
        ),
        120,
    )
    assert world.condition(ep, "Degraded")["reason"] == "RolloutFailed"
    assert world.events("RolledBack")
    until(
        "the Deployment is back on the stable version",
        lambda: (
            _deployment(world)["spec"]["template"]["metadata"]["annotations"]["preheat.dev/version"]
            == stable
        ),
        30,
    )
    until(
        "2 stable pods ready",
        lambda: _versions(world.ready_pods()) == {stable} and len(world.ready_pods()) == 2,
        60,
    )


def test_a_lost_node_s_pod_is_replaced_and_the_node_comes_back_warm(world: World) -> None:
    """Deleting a warm Node that runs a pod: its pod is replaced on a live node; the node
    re-registered keeps its store, gets its revision label back and counts as warm again."""
    _, v2, v2_digest = world.models["v2"]
    label = revision_label(v2_digest)
    # Which nodes run pods depends on where the scheduler put them in the tests before.
    with_pods = {p["spec"].get("nodeName") for p in world.pods()}
    warm = {n for n in NODES if world.get(f"/api/v1/nodes/{n}")["metadata"]["labels"].get(label)}
    candidates = sorted(with_pods & warm)
    assert candidates, (with_pods, warm)
    lost = candidates[0]
    world.kube.kubectl("delete", "node", lost, "--wait=false")
    until(
        f"2 ready pods, none on {lost}",
        lambda: (
            len(world.ready_pods()) == 2
            and all(p["spec"].get("nodeName") != lost for p in world.pods())
        ),
        90,
    )
    assert world.events("PodReplaced")
    world.kube.stop_node(lost)
    world.kube.add_node(lost, labels=NODES[lost], cpu="4")
    until(
        f"{lost} labelled again",
        lambda: world.get(f"/api/v1/nodes/{lost}")["metadata"]["labels"].get(label),
        60,
    )
    until(
        "as many warm nodes as before",
        lambda: world.endpoint()["status"].get("warmNodes") == len(warm),
        30,
    )
    assert v2 in {c["spec"]["revision"] for c in world.get(f"{API}/modeldatacaches")["items"]}


def test_deleting_the_endpoint_leaves_no_orphan(world: World) -> None:
    """The endpoint's Deployment, Service, caches and pods all go with it."""
    world.kube.rest().must("DELETE", f"{API}/inferenceendpoints/chat")
    sel = "labelSelector=preheat.dev/endpoint%3Dchat"

    def gone() -> bool:
        return (
            world.call("GET", f"{API}/inferenceendpoints/chat")[0] == 404
            and not world.get(f"/apis/apps/v1/namespaces/{NS}/deployments?{sel}")["items"]
            and not world.get(f"/apis/apps/v1/namespaces/{NS}/replicasets?{sel}")["items"]
            and not world.get(f"/api/v1/namespaces/{NS}/services?{sel}")["items"]
            and not world.get(f"{API}/modeldatacaches")["items"]
            and not world.get(f"/api/v1/namespaces/{NS}/pods?{sel}")["items"]
        )

    until("nothing of the endpoint left", gone, 90)
    assert "preheat_operator_actions_total" in _metrics(world)
