"""`preheat router serve --kubernetes` on a real v1.20.2 control plane.

The router process discovers the endpoint's pods from their EndpointSlices
(``discovery.k8s.io/v1beta1`` on 1.20) and its strategy from the InferenceEndpoint, with a
kubeconfig of the ServiceAccount bound to the rendered router Role (so RBAC is real). The
pods are `preheat engine serve` processes run by the kubelet stand-in on 127.x addresses;
traffic goes to those pod IPs only (nothing routes ClusterIPs here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from preheat.runtime.kubernetes.api_client import discovery_version
from preheat.runtime.kubernetes.discovery_slices import (
    desired_instances,
    slice_endpoints,
    variant_service_name,
)
from preheat.runtime.kubernetes.render import endpoint_manifests
from preheat.runtime.kubernetes.resources import load_endpoint_file
from preheat.runtime.procs import start_process
from preheat.testing.kube import KubeCluster, write_kubeconfig
from preheat.testing.kubespace import kube_share
from preheat.testing.procs import Process, free_port
from tests.integration.test_k8s_cluster import _engine_deployment

pytestmark = pytest.mark.kubernetes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "endpoint.yaml"  # endpoint "chat", prefix_aware, 2048, 8
NS = "k8s-router"
NODES = {"rtr-a": {"pool": "gpu"}, "rtr-b": {"pool": "gpu"}}
TOKEN = "router-admin-token-for-tests"
IE_PATH = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/inferenceendpoints/chat"
SERVICE = variant_service_name("chat", "main")


@pytest.fixture(scope="module")
def kube(kube_session: KubeCluster) -> Iterator[KubeCluster]:
    """This module's share of the session cluster: namespace k8s-router and two stand-in
    nodes (removed, with all the module made, when it ends)."""
    with kube_share(kube_session, namespaces=[NS], nodes=NODES) as cluster:
        yield cluster


def _preheat(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "preheat"
    return subprocess.run(
        [str(exe), *args], check=check, capture_output=True, text=True, timeout=60, **kw
    )


def _engines(kube: KubeCluster, replicas: int) -> list[dict[str, Any]]:
    """A Deployment of simulated engines for variant `main` of `chat` (test_k8s_cluster's,
    reading a snapshot from each node's store), and the Service the router discovers."""
    for name in NODES:
        snap = kube.root / "nodes" / name / "var/lib/preheat/store/snap"
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "weights.bin").write_bytes(name.encode() * 100)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": NS},
        "spec": {"selector": {"app": "chat"}, "ports": [{"name": "http", "port": 8000}]},
    }
    return [_engine_deployment("chat", replicas, affinity_label=None, namespace=NS), service]


def _ready_pod_urls(kube: KubeCluster) -> set[str]:
    pods = kube.rest().get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app=chat")["items"]
    out = set()
    for p in pods:
        conds = {c["type"]: c["status"] for c in p["status"].get("conditions") or ()}
        if conds.get("Ready") == "True" and not p["metadata"].get("deletionTimestamp"):
            out.add(f"http://{p['status']['podIP']}:8000")
    return out


class RouterProc:
    """The `preheat router serve --kubernetes` child and a client for it."""

    def __init__(self, proc: Process, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def config(self) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + "/admin/config", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            body: dict[str, Any] = json.loads(r.read())
        return body

    def instances(self) -> dict[str, str]:
        (main,) = self.config()["variants"]
        return {i["url"]: i["state"] for i in main["instances"]}

    def complete(self, prompt: str) -> tuple[int, str]:
        """POST one completion; (status, the instance the router says it used)."""
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps({"model": "chat", "prompt": prompt, "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=15) as r:
                json.loads(r.read())
                return r.status, r.headers.get("X-Preheat-Instance", "")
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read().decode(errors="replace")[:200]


@pytest.fixture(scope="module")
def router(kube: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    """Two engine pods behind Service chat-main, the `chat` InferenceEndpoint with the
    rendered router RBAC, and the router running as that ServiceAccount."""
    spec, pod = load_endpoint_file(EXAMPLE)
    wanted = {"ServiceAccount", "Role", "RoleBinding", "InferenceEndpoint"}
    objects = [o for o in endpoint_manifests(spec, namespace=NS, pod=pod) if o["kind"] in wanted]
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects + _engines(kube, 2)))
    kube.wait_for("2 engine pods Ready", lambda: len(_ready_pod_urls(kube)) == 2, timeout=60)
    tmp = tmp_path_factory.mktemp("router")
    kubeconfig = kube.sa_kubeconfig(tmp / "router.kubeconfig", NS, "preheat-router-chat")
    port = free_port()
    log = tmp / "router.log"
    env = {
        **os.environ,
        "PREHEAT_ADMIN_TOKEN": TOKEN,
        "PREHEAT_ROUTER_SALT": "a-salt-of-at-least-16-bytes",
    }
    proc = start_process(
        [
            str(Path(sys.executable).parent / "preheat"),
            "router",
            "serve",
            "--kubernetes",
            "--endpoint",
            "chat",
            "--namespace",
            NS,
            "--kubeconfig",
            str(kubeconfig),
            "--port",
            str(port),
            "--health-interval",
            "0.5",
        ],
        log,
        env=env,
        inherit_env=False,
    )
    rp = RouterProc(proc, port, log)
    try:

        def up() -> bool:
            assert proc.running, log.read_text()
            try:
                return set(rp.instances()) == _ready_pod_urls(kube)
            except OSError:
                return False

        kube.wait_for("the router lists both pods", up, timeout=30)
        yield rp
    finally:
        proc.stop()
        kube.kubectl("delete", "-n", NS, "deployment/chat", f"service/{SERVICE}", "--wait=false")


def _set_routing(kube: KubeCluster, rp: RouterProc, **routing: Any) -> dict[str, Any]:
    """Patch the InferenceEndpoint's spec.routing and wait until the router shows it."""
    kube.rest().must(
        "PATCH", IE_PATH, {"spec": {"routing": routing}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    names = {"prefixLength": "prefix_length", "concurrencyThreshold": "concurrency_threshold"}
    want = {names.get(k, k): v for k, v in routing.items()}

    def shown() -> dict[str, Any] | None:
        (main,) = rp.config()["variants"]
        return main if all(main[k] == v for k, v in want.items()) else None

    shown_: dict[str, Any] = kube.wait_for(f"the router applies {want}", shown, timeout=20)
    return shown_


def _completions_served(url: str) -> float:
    """vllm:request_success_total summed over reasons, from one engine's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_router_routes_completions_to_the_discovered_pods(
    kube: KubeCluster, router: RouterProc
) -> None:
    """The router's only instances are the Ready pods' 127.x IPs from the EndpointSlices,
    its routing is the InferenceEndpoint's, and every completion is served by a pod (the
    engines' own /metrics count exactly the requests sent)."""
    pods = _ready_pod_urls(kube)
    assert all(u.startswith("http://127.") for u in pods)
    (main,) = router.config()["variants"]
    assert main["name"] == "main"
    assert (main["strategy"], main["prefix_length"], main["concurrency_threshold"]) == (
        "prefix_aware", 2048, 8,
    )  # fmt: skip
    assert {i["url"]: i["state"] for i in main["instances"]} == dict.fromkeys(pods, "healthy")
    before = {u: _completions_served(u) for u in pods}
    used = Counter()
    for i in range(20):
        status, instance = router.complete(f"request {i}: " + "tell me a story " * 20)
        assert status == 200, instance
        used[instance] += 1
    assert set(used) <= pods
    served = {u: _completions_served(u) - before[u] for u in pods}
    assert sum(served.values()) == 20
    assert served == {u: float(used[u]) for u in pods}


def test_routing_spec_change_applies_live(kube: KubeCluster, router: RouterProc) -> None:
    """Changing spec.routing on the InferenceEndpoint switches the running router's
    strategy and threshold (GET /admin/config) without a restart, instances kept; a
    status-only update applies nothing."""
    pid = router.proc.pid
    pods = set(router.instances())
    main = _set_routing(kube, router, strategy="least_outstanding", concurrencyThreshold=16)
    assert main["strategy"] == "least_outstanding" and main["concurrency_threshold"] == 16
    assert set(router.instances()) == pods and router.proc.pid == pid
    main = _set_routing(kube, router, strategy="random")
    assert router.complete("after the switch")[0] == 200
    assert router.proc.running
    # A status-only update (what the operator writes) is not a routing change: the watch
    # delivers it before the next spec change, and only the spec change is applied.
    applied = router.log.read_text().count("routing from InferenceEndpoint")
    kube.rest().must(
        "PATCH", IE_PATH + "/status", {"status": {"readyReplicas": 2}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    _set_routing(kube, router, concurrencyThreshold=12)
    assert router.log.read_text().count("routing from InferenceEndpoint") == applied + 1


def test_a_pod_failing_readiness_is_drained_then_taken_back(
    kube: KubeCluster, router: RouterProc
) -> None:
    """A pod whose process is frozen (SIGSTOP) fails its readiness probe: its EndpointSlice
    entry turns not ready and the router drains it (kept, sent nothing new); resumed, it is
    ready again and the router routes to it again."""
    pods = kube.rest().get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app=chat")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    pod = live[0]
    url = f"http://{pod['status']['podIP']}:8000"
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("standin://"))
    os.kill(pid, signal.SIGSTOP)
    try:
        kube.wait_for(
            f"{url} drained", lambda: router.instances().get(url) == "draining", timeout=40
        )
        others = [u for u, st in router.instances().items() if u != url and st == "healthy"]
        assert others, router.instances()
        for i in range(5):
            status, used = router.complete(f"while {url} is drained {i}")
            assert status == 200 and used != url
    finally:
        os.kill(pid, signal.SIGCONT)
    kube.wait_for(
        f"{url} healthy again", lambda: router.instances().get(url) == "healthy", timeout=40
    )


def test_scaling_adds_and_removes_instances_without_a_failed_request(
    kube: KubeCluster, router: RouterProc
) -> None:
    """Under a bounded load loop, scaling the Deployment 2 -> 3 adds the new pod (it gets
    traffic) and 3 -> 1 removes two, and no request fails."""
    _set_routing(kube, router, strategy="random")
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def load(n: int) -> None:
        # Runs until the test stops it (bounded: 80 s, 30,000 requests). A request that
        # raises (refused, reset, timed out) is a failed request, recorded as status 0:
        # a thread that died on it would stop the load and hide why.
        deadline = time.monotonic() + 80
        for i in range(30_000):
            if stop.is_set() or time.monotonic() > deadline:
                return
            try:
                results.append(router.complete(f"load {n}.{i}"))
            except OSError as exc:
                results.append((0, repr(exc)))

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    try:
        two = set(router.instances())
        kube.kubectl("scale", "-n", NS, "deployment/chat", "--replicas=3")

        def third_serves() -> str | None:
            new = set(router.instances()) - two
            if len(new) == 1 and new <= _ready_pod_urls(kube):
                (url,) = new
                return url if any(inst == url for _, inst in list(results)) else None
            return None

        added = kube.wait_for("the third pod is an instance and gets traffic", third_serves, 40)
        kube.kubectl("scale", "-n", NS, "deployment/chat", "--replicas=1")

        def one_left() -> set[str] | None:
            now = set(router.instances())
            return now if len(now) == 1 and now == _ready_pod_urls(kube) else None

        left = kube.wait_for("the router is down to the one pod left", one_left, timeout=40)
        mark = len(results)
        kube.wait_for(
            "requests after scale-in",
            lambda: len(results) >= mark + 20 or [r for r in results if r[0] != 200],
            timeout=20,
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=20)
    failed = [r for r in results if r[0] != 200]
    assert not failed, failed[:5]
    assert added.startswith("http://127.")
    assert {inst for _, inst in results[mark + 2 :]} == left  # 2 were in flight at most
    print(f"scale 2->3->1 under load: {len(results)} requests, 0 failed")


def test_a_variant_added_to_the_spec_gets_its_services_pods(
    kube: KubeCluster, router: RouterProc
) -> None:
    """Adding variant `canary` to the InferenceEndpoint adds a router variant whose
    instances are the pods behind Service chat-canary (listed at once, then watched);
    requests for that variant reach them; removing the variant takes it out again."""
    canary = variant_service_name("chat", "canary")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": canary, "namespace": NS},
        "spec": {"selector": {"app": canary}, "ports": [{"name": "http", "port": 8000}]},
    }
    deployment = _engine_deployment(canary, 1, affinity_label=None, namespace=NS)
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([deployment, service]))
    stored = kube.rest().get(IE_PATH)["spec"]["variants"]
    try:
        variants = [*stored, {**stored[0], "name": "canary", "weight": 0.5}]
        kube.rest().must(
            "PATCH", IE_PATH, {"spec": {"variants": variants}},
            content_type="application/merge-patch+json",
        )  # fmt: skip

        def canary_instances() -> list[str] | None:
            by_name = {v["name"]: v for v in router.config()["variants"]}
            got = [i["url"] for i in by_name.get("canary", {}).get("instances", ())]
            return got or None

        (url,) = kube.wait_for("the canary variant has its pod", canary_instances, timeout=45)
        pods = kube.rest().get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app={canary}")
        assert url == f"http://{pods['items'][0]['status']['podIP']}:8000"
        req = urllib.request.Request(
            router.url + "/v1/completions",
            data=json.dumps({"prompt": "to the canary", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json", "X-Preheat-Variant": "canary"},
        )
        with urllib.request.urlopen(req, timeout=15) as r:
            assert r.headers["X-Preheat-Instance"] == url
    finally:
        kube.rest().must(
            "PATCH", IE_PATH, {"spec": {"variants": stored}},
            content_type="application/merge-patch+json",
        )  # fmt: skip
        kube.kubectl(
            "delete", "-n", NS, f"deployment/{canary}", f"service/{canary}", "--wait=false"
        )
    kube.wait_for(
        "the canary variant is gone",
        lambda: [v["name"] for v in router.config()["variants"]] == ["main"],
        timeout=20,
    )


def test_slice_api_version_comes_from_api_discovery(kube: KubeCluster, router: RouterProc) -> None:
    """1.20 serves no discovery.k8s.io/v1, so discovery picks v1beta1 (and says so)."""
    from kubernetes import config

    with config.new_client_from_config(config_file=str(kube.kubeconfig)) as api:
        assert discovery_version(api) == "v1beta1"
    assert "discovery.k8s.io/v1beta1 EndpointSlices of chat-main" in router.log.read_text()


def test_slice_endpoints_read_ready_terminating_and_ports() -> None:
    """An unset `ready` counts as ready (the API's rule), `terminating` or ready=false as
    not ready; the port named http wins; IPv6 addresses are bracketed; the slices of
    other Services are ignored and an address ready in one slice is ready."""
    ports = [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}]
    ours = {
        "metadata": {"labels": {"kubernetes.io/service-name": "chat-main"}},
        "ports": ports,
        "endpoints": [
            {"addresses": ["127.1.0.2"]},
            {"addresses": ["127.1.0.3"], "conditions": {"ready": False}},
            {"addresses": ["127.1.0.4"], "conditions": {"ready": True, "terminating": True}},
            {"addresses": ["fd00::5"], "conditions": {"ready": True}},
        ],
    }
    again = {**ours, "endpoints": [{"addresses": ["127.1.0.3"], "conditions": {"ready": True}}]}
    other = {**ours, "metadata": {"labels": {"kubernetes.io/service-name": "other"}}}
    assert desired_instances([ours, other], {"chat-main": "main"}) == {
        "main": {
            "http://127.1.0.2:8000": True,
            "http://127.1.0.3:8000": False,
            "http://127.1.0.4:8000": False,
            "http://[fd00::5]:8000": True,
        }
    }
    assert desired_instances([ours, again], {"chat-main": "main"})["main"]["http://127.1.0.3:8000"]
    assert slice_endpoints({**ours, "ports": []}) == []


def test_variant_service_names_are_dns_labels() -> None:
    """ENDPOINT-VARIANT, and a pair too long for a DNS label is cut with a digest."""
    assert variant_service_name("chat", "main") == "chat-main"
    long = variant_service_name("e" * 40, "v" * 40)
    assert (
        len(long) <= 63
        and long.startswith("e" * 40)
        and long != variant_service_name("e" * 40, "v" * 41)
    )


def test_unknown_endpoint_fails_naming_it_and_the_namespace(
    kube: KubeCluster, router: RouterProc, tmp_path: Path
) -> None:
    """--endpoint that does not exist: exit 2 before listening, the message names the
    endpoint and the namespace."""
    out = _preheat(
        "router", "serve", "--kubernetes", "--endpoint", "nope", "--namespace", NS,
        "--kubeconfig", str(kube.kubeconfig), "--port", str(free_port()),
        check=False,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert f"InferenceEndpoint 'nope' in namespace '{NS}' not found" in out.stderr


def test_credentials_without_the_router_role_are_refused_clearly(
    kube: KubeCluster, router: RouterProc, tmp_path: Path
) -> None:
    """A ServiceAccount not bound to the router Role gets a 403 from the API server; the
    router exits 2 naming the endpoint, the namespace and the fix (bind the Role)."""
    kube.kubectl("create", "serviceaccount", "nobody", "-n", NS)
    kubeconfig = kube.sa_kubeconfig(tmp_path / "nobody.kubeconfig", NS, "nobody")
    out = _preheat(
        "router", "serve", "--kubernetes", "--endpoint", "chat", "--namespace", NS,
        "--kubeconfig", str(kubeconfig), "--port", str(free_port()),
        check=False,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert f"reading InferenceEndpoint 'chat' in namespace '{NS}' was refused (403" in out.stderr
    assert "Role" in out.stderr and kube.service_account_token(NS, "nobody") not in (
        out.stderr + out.stdout
    )


def test_an_unreachable_api_server_is_named(kube: KubeCluster, tmp_path: Path) -> None:
    """A kubeconfig whose server answers nothing: exit 2 naming the server address."""
    server = f"https://127.0.0.1:{free_port()}"
    kubeconfig = write_kubeconfig(
        tmp_path / "gone.kubeconfig", server=server, ca_file=kube.ca_file, token="t", user="u"
    )
    out = _preheat(
        "router", "serve", "--kubernetes", "--endpoint", "chat",
        "--kubeconfig", str(kubeconfig), "--port", str(free_port()),
        check=False,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert f"cannot reach the Kubernetes API server {server}" in out.stderr


def test_kubernetes_options_are_checked_before_connecting(tmp_path: Path) -> None:
    """--endpoint without --kubernetes, --kubernetes without --endpoint or with --backend,
    and a missing --kubeconfig file are usage errors that say what to change."""
    cases = {
        ("--endpoint", "chat"): "need --kubernetes",
        ("--kubernetes",): "--kubernetes needs --endpoint NAME",
        ("--kubernetes", "--endpoint", "chat", "--backend", "http://127.0.0.1:1"): (
            "leave out --config and --backend"
        ),
        ("--kubernetes", "--endpoint", "chat", "--kubeconfig", str(tmp_path / "none")): (
            "does not exist"
        ),
    }
    for args, message in cases.items():
        out = _preheat("router", "serve", "--port", "1", *args, check=False)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_slice_kv_event_ports_become_each_instances_publisher() -> None:
    """Ports named kv-events and kv-replay give each address tcp://ADDRESS:PORT (with the
    replay endpoint and the endpoint-wide hash options); a slice without them, none."""
    from preheat.runtime.kubernetes.discovery_slices import kv_event_endpoints

    ports = [{"name": "http", "port": 8000}, {"name": "kv-events", "port": 5557}]
    sl = {
        "metadata": {"labels": {"kubernetes.io/service-name": "chat-main"}},
        "ports": [*ports, {"name": "kv-replay", "port": 5558}],
        "endpoints": [{"addresses": ["127.1.0.2"]}],
    }
    got = kv_event_endpoints([sl], {"chat-main": "main"}, "hash=sha256_cbor&hash_seed=0")
    assert got == {
        "http://127.1.0.2:8000": "tcp://127.1.0.2:5557?replay=tcp://127.1.0.2:5558"
        "&hash=sha256_cbor&hash_seed=0"
    }
    assert kv_event_endpoints([{**sl, "ports": ports[:1]}], {"chat-main": "main"}) == {}


def test_discovered_kv_event_ports_are_subscribed(kube: KubeCluster, router: RouterProc) -> None:
    """An EndpointSlice of the variant's Service whose ports include kv-events/kv-replay
    (created on the API server) makes the running router list that instance with its
    publisher; deleting the slice removes both."""
    from kubernetes import config

    with config.new_client_from_config(config_file=str(kube.kubeconfig)) as api:
        version = discovery_version(api)
    base = f"/apis/discovery.k8s.io/{version}/namespaces/{NS}/endpointslices"
    sl = {
        "apiVersion": f"discovery.k8s.io/{version}",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "chat-main-kv",
            "labels": {
                "kubernetes.io/service-name": SERVICE,
                "endpointslice.kubernetes.io/managed-by": "preheat-tests",
            },
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8000, "protocol": "TCP"},
            {"name": "kv-events", "port": 5557, "protocol": "TCP"},
            {"name": "kv-replay", "port": 5558, "protocol": "TCP"},
        ],
        "endpoints": [{"addresses": ["127.0.0.250"], "conditions": {"ready": True}}],
    }
    kube.rest().must("POST", base, sl)
    url = "http://127.0.0.250:8000"
    try:
        deadline = time.monotonic() + 30
        while True:
            (main,) = router.config()["variants"]
            inst = {i["url"]: i for i in main["instances"]}
            if url in inst and "kv_events" in inst[url]:
                break
            assert time.monotonic() < deadline, f"not discovered: {main['instances']}"
            time.sleep(0.3)
        assert inst[url]["kv_events"] == "tcp://127.0.0.250:5557?replay=tcp://127.0.0.250:5558"
        assert inst[url]["kv_events_status"]["state"] == "waiting"
    finally:
        kube.rest().must("DELETE", f"{base}/chat-main-kv")
    deadline = time.monotonic() + 30
    while url in router.instances():
        assert time.monotonic() < deadline, "the slice's instance was not removed"
        time.sleep(0.3)
