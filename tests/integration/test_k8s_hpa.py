"""The rendered HPA on a real v1.20.2 control plane, fed by `preheat metrics-adapter`.

Real: the API server with its aggregator (the adapter is registered by the rendered
`APIService`, with `caBundle` set to the adapter's generated certificate, so the
aggregator verifies it), the controller-manager's HPA controller (sync period 1 s, the
only test setting), the scheduler, the Deployment and ReplicaSet controllers, `preheat
operator`, the router and the adapter as processes with the rendered ServiceAccounts'
tokens, and engine pods run by the kubelet stand-in.

Two test-cluster bindings (nothing routes ClusterIPs here, and Endpoints may not hold
127.0.0.0/8 addresses): the adapter's Service is an `ExternalName` Service for
127.0.0.1 (the aggregator dials ExternalName Services by name), and the router, a host
process on 127.0.0.1, is published through a hand-written EndpointSlice of its
selector-less `preheat-router-chat` Service, where the adapter finds it as it would
find router pods.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from preheat.bench.models import generate_model, write_http_manifest
from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.render import endpoint_manifests, system_manifests
from preheat.runtime.kubernetes.render_adapter import ADAPTER_NAME, api_service
from preheat.runtime.procs import start_process
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.origins import nginx_origin
from preheat.testing.procs import Process, free_port

pytestmark = pytest.mark.kubernetes

NS = "k8s-hpa"
SYSTEM = "preheat-system"
PREHEAT = str(Path(sys.executable).parent / "preheat")
METRIC_PATH = (
    f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{NS}/preheat_router_in_flight"
    "?labelSelector=endpoint%3Dchat%2Cvariant%3Dmain"
)
HPA = f"/apis/autoscaling/v2beta2/namespaces/{NS}/horizontalpodautoscalers/chat-main"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/chat-main"


@dataclass
class World:
    kube: KubeCluster
    base: Path
    router_port: int
    adapter_port: int
    hpa: dict[str, Any]
    procs: dict[str, Process] = field(default_factory=dict)
    numbers: dict[str, Any] = field(default_factory=dict)

    def get(self, path: str) -> Any:
        return self.kube.rest().get(path)

    def ready_replicas(self) -> int | None:
        """The Deployment's ready replicas, or None before the operator created it."""
        status, dep = self.kube.rest().call("GET", DEPLOYMENT)
        return int(dep.get("status", {}).get("readyReplicas") or 0) if status == 200 else None

    def replicas(self) -> int:
        return int(self.get(DEPLOYMENT)["spec"]["replicas"])

    def complete(self) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.router_port}/v1/completions",
            data=json.dumps(
                {"model": "chat", "prompt": "count slowly", "max_tokens": 250}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
                return int(r.status)
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code
        except OSError:
            return 0


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's share of the session cluster (namespace k8s-hpa, one node), the
    rendered RBAC, endpoint and HPA, the operator, router and adapter processes, and the
    APIService (processes stopped by PID, objects removed by the share)."""
    base = tmp_path_factory.mktemp("k8s-hpa")
    generate_model(base / "origin" / "m", 100_000, shards=1, seed=7)
    write_http_manifest(base / "origin" / "m")
    with (
        nginx_origin(base / "origin") as nginx,
        kube_share(kube_session, namespaces=[NS], nodes={"hpa-a": {}}) as kube,
    ):
        t0 = time.monotonic()
        spec = parse_endpoint(
            {
                "name": "chat",
                "model": {"source": nginx.url("m/preheat-manifest.json")},
                "engine": {"simulated": {"profile": "tiny", "time_scale": 4}},
                "replicas": {"min": 1, "max": 2},
                "autoscaling": {"targetInFlight": 2, "cooldownSeconds": 3},
                "modelCacheConfig": {"weights": {"enabled": False}},
            },
            origin="test",
        )
        rbac = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                "RoleBinding"}  # fmt: skip
        rendered = system_manifests() + endpoint_manifests(spec, namespace=NS)
        kube.kubectl(
            "apply", "-f", "-", input=yaml.safe_dump_all([o for o in rendered if o["kind"] in rbac])
        )
        (hpa,) = [o for o in rendered if o["kind"] == "HorizontalPodAutoscaler"]
        world = World(kube, base, free_port(), free_port(), hpa)
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        try:
            # The endpoint first: the router reads it on start, so all three processes
            # can start at once.
            kube.kubectl(
                "apply", "-f", "-",
                input=yaml.safe_dump_all([o for o in rendered if o["kind"] == "InferenceEndpoint"]),
            )  # fmt: skip
            _start(world, env)
            world.numbers["setup_s"] = round(time.monotonic() - t0, 1)
            yield world
        finally:
            stops = [threading.Thread(target=p.stop, args=(10,)) for p in world.procs.values()]
            for t in stops:  # in parallel: each may take seconds to exit under load
                t.start()
            for t in stops:
                t.join()
            if world.numbers:
                print("\nk8s hpa numbers:", json.dumps(world.numbers))


def _start(world: World, env: dict[str, str]) -> None:
    kube, base = world.kube, world.base
    op_conf = kube.sa_kubeconfig(base / "operator.kubeconfig", SYSTEM, "preheat-operator")
    world.procs["operator"] = start_process(
        [PREHEAT, "operator", "--kubeconfig", str(op_conf), "--namespace", NS,
         "--metrics-port", str(free_port()), "--tick", "1"],
        base / "operator.log", env=env, inherit_env=False,
    )  # fmt: skip
    router_conf = kube.sa_kubeconfig(base / "router.kubeconfig", NS, "preheat-router-chat")
    world.procs["router"] = start_process(
        [PREHEAT, "router", "serve", "--kubernetes", "--endpoint", "chat", "--namespace", NS,
         "--kubeconfig", str(router_conf), "--port", str(world.router_port),
         "--health-interval", "0.5"],
        base / "router.log",
        env={**env, "PREHEAT_ROUTER_SALT": "a-salt-of-at-least-16-bytes"}, inherit_env=False,
    )  # fmt: skip
    certs = base / "adapter-certs"
    adapter_conf = kube.sa_kubeconfig(base / "adapter.kubeconfig", SYSTEM, ADAPTER_NAME)
    world.procs["adapter"] = start_process(
        [PREHEAT, "metrics-adapter", "--kubeconfig", str(adapter_conf), "--port",
         str(world.adapter_port), "--cert-dir", str(certs), "--tls-san",
         f"{ADAPTER_NAME}.{SYSTEM}.svc", "--tls-san", "127.0.0.1"],
        base / "adapter.log", env=env, inherit_env=False,
    )  # fmt: skip
    kube.wait_for("the adapter's certificate", lambda: (certs / "tls.crt").is_file(), 30)
    router_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "preheat-router-chat", "namespace": NS},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": world.router_port}]},
    }
    router_slice = {
        "apiVersion": "discovery.k8s.io/v1beta1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "preheat-router-chat-host",
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": "preheat-router-chat"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": world.router_port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    }
    adapter_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": ADAPTER_NAME, "namespace": SYSTEM},
        "spec": {
            "type": "ExternalName",
            "externalName": "127.0.0.1",
            "ports": [{"name": "https", "port": world.adapter_port}],
        },
    }
    registration = api_service(
        SYSTEM, port=world.adapter_port, ca_bundle=(certs / "tls.crt").read_bytes()
    )
    objs = [router_service, router_slice, adapter_service, registration]
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))

    def available() -> bool:
        assert world.procs["adapter"].running, (base / "adapter.log").read_text()[-2000:]
        got = kube.rest().get(
            "/apis/apiregistration.k8s.io/v1/apiservices/" + registration["metadata"]["name"]
        )
        conds = {c["type"]: c for c in (got.get("status") or {}).get("conditions") or ()}
        return conds.get("Available", {}).get("status") == "True"

    kube.wait_for("the APIService is Available", available, 30)
    # The aggregator adds its proxy route a moment after the condition turns True.
    served = lambda: kube.rest().call("GET", "/apis/external.metrics.k8s.io/v1beta1")[0] == 200  # noqa: E731
    kube.wait_for("the aggregator serves external.metrics.k8s.io", served, 30)

    def up() -> bool:
        assert world.procs["router"].running, (base / "router.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{world.router_port}/metrics", timeout=2):
                return True
        except OSError:
            return False

    kube.wait_for("the router's /metrics", up, 30)


def test_the_adapter_serves_the_external_metrics_api_through_the_aggregator(world: World) -> None:
    """Through the API server: discovery lists preheat_router_in_flight, a query with the
    HPA's selector answers an ExternalMetricValueList (0 in flight); straight to the
    adapter without the front-proxy certificate is 401, the router's token is 403, and a
    selector without endpoint= is 400 naming the fix."""
    kube = world.kube
    disc = json.loads(kube.kubectl("get", "--raw", "/apis/external.metrics.k8s.io/v1beta1").stdout)
    assert [r["name"] for r in disc["resources"]] == ["preheat_router_in_flight"]
    got = kube.wait_for(
        "a metric value", lambda: json.loads(kube.kubectl("get", "--raw", METRIC_PATH).stdout), 20
    )
    assert got["kind"] == "ExternalMetricValueList"
    (item,) = got["items"]
    assert item["metricLabels"] == {"endpoint": "chat", "variant": "main"}
    assert item["value"] == "0" and item["timestamp"].endswith("Z")
    # Without the aggregator's client certificate (TLS verified with the served cert).
    ctx = ssl.create_default_context(cafile=str(world.base / "adapter-certs" / "tls.crt"))
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(
            f"https://127.0.0.1:{world.adapter_port}{METRIC_PATH}", context=ctx, timeout=5
        )
    with err.value:
        assert err.value.code == 401 and b"front-proxy" in err.value.read()
    router = kube.rest(kube.service_account_token(NS, "preheat-router-chat"))
    status, body = router.call("GET", METRIC_PATH)
    assert status == 403 and "preheat-router-chat" in json.dumps(body), body
    status, body = kube.rest().call("GET", METRIC_PATH.replace("endpoint%3Dchat%2C", ""))
    assert status == 400 and "endpoint=NAME" in body["message"], body


def test_load_scales_the_deployment_up_the_operator_keeps_it_and_idle_scales_down(
    world: World,
) -> None:
    """Five concurrent slow requests through the router raise preheat_router_in_flight
    above 2 per replica: the HPA scales chat-main 1 -> 2 and the operator, ticking every
    second, leaves 2 in place while load lasts; when load stops the HPA returns to 1 after
    its 3 s scale-down window. Every request answers 200."""
    kube = world.kube
    kube.wait_for("chat-main at 1 ready replica", lambda: world.ready_replicas() == 1, 60)
    kube.wait_for("the router lists the pod", lambda: world.complete() == 200, 30)
    # The HPA once its Deployment and metric exist: the controller-manager's event spam
    # filter (25 per object) would otherwise drop SuccessfulRescale after a burst of
    # FailedGetScale warnings at 1 s syncs.
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(world.hpa))
    stop = threading.Event()
    statuses: list[int] = []
    deadline = time.monotonic() + 50

    def load() -> None:
        for _ in range(200):  # bounded: ~2 s per request, stopped by the event or deadline
            if stop.is_set() or time.monotonic() > deadline:
                return
            statuses.append(world.complete())

    threads = [threading.Thread(target=load) for _ in range(5)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    try:
        kube.wait_for("the HPA scales chat-main to 2", lambda: world.replicas() == 2, 30)
        world.numbers["scale_up_s"] = round(time.monotonic() - t0, 1)
        hpa = world.get(HPA)
        (metric,) = hpa["status"]["currentMetrics"]
        assert metric["external"]["metric"]["name"] == "preheat_router_in_flight"
        kube.wait_for("2 ready replicas", lambda: world.ready_replicas() == 2, 40)
        seen = set()
        for _ in range(8):  # 4 s: four operator passes and four HPA syncs
            seen.add(world.replicas())
            time.sleep(0.5)
        assert seen == {2}, seen
        out = kube.kubectl("get", "hpa", "chat-main", "-n", NS).stdout
        world.numbers["kubectl_get_hpa"] = out.strip().splitlines()
    finally:
        stop.set()
        for t in threads:
            t.join(40)
    t1 = time.monotonic()
    kube.wait_for("the HPA scales chat-main back to 1", lambda: world.replicas() == 1, 40)
    world.numbers["scale_down_s"] = round(time.monotonic() - t1, 1)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    ep = world.get(f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/inferenceendpoints/chat")
    assert ep["spec"]["replicas"]["min"] == 1  # the spec never changed: the HPA did it
    reasons = [
        e.get("message", "")
        for e in world.get(f"/api/v1/namespaces/{NS}/events")["items"]
        if e.get("reason") == "SuccessfulRescale"
    ]
    assert any("New size: 2" in m and "preheat_router_in_flight" in m for m in reasons), reasons
    assert any("New size: 1" in m for m in reasons), reasons


def test_a_router_that_does_not_answer_fails_the_query_and_the_hpa_keeps_its_count(
    world: World,
) -> None:
    """With the router stopped but still listed ready, the metric query is 503 naming the
    router (no sum without it, which would read as less load) and the HPA holds chat-main
    at its count, reporting that it cannot get the metric."""
    kube = world.kube
    world.procs.pop("router").stop(10)
    status, body = kube.rest().call("GET", METRIC_PATH)
    assert status == 503, body
    assert f"127.0.0.1:{world.router_port}/metrics" in body["message"], body

    def failing() -> bool:
        conds = {c["type"]: c for c in world.get(HPA)["status"].get("conditions") or ()}
        return conds.get("ScalingActive", {}).get("reason") == "FailedGetExternalMetric"

    kube.wait_for("the HPA reports FailedGetExternalMetric", failing, 20)
    assert world.replicas() == 1
