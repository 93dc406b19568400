"""Kubernetes mode on a real v1.20.2 control plane (etcd, kube-apiserver, controller-manager,
scheduler from scripts/build-kube.sh) on 127.0.0.1.

The only stand-in is the kubelet (preheat.testing.kubelet): it runs the pods the real
scheduler binds to its node as local processes on their own 127.x.y.z address. One cluster
serves the whole module; objects are checked through the API as a user would with kubectl.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from preheat.runtime.kubernetes.render import (
    AGENT_RULES,
    ROUTER_RULES,
    endpoint_manifests,
    system_manifests,
)
from preheat.runtime.kubernetes.resources import endpoint_from_object, load_endpoint_file
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share

pytestmark = pytest.mark.kubernetes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "endpoint.yaml"
NS = "k8s-cluster"
NODES = {"clu-a": {"pool": "gpu"}, "clu-b": {"pool": "gpu"}, "clu-c": {}}


@pytest.fixture(scope="module")
def kube(kube_session: KubeCluster) -> Iterator[KubeCluster]:
    """This module's share of the session cluster: namespace k8s-cluster and three
    stand-in nodes (two labelled pool=gpu); the CRDs are installed."""
    with kube_share(kube_session, namespaces=[NS], nodes=NODES) as cluster:
        yield cluster


def _preheat(*args: str) -> str:
    exe = Path(sys.executable).parent / "preheat"
    return subprocess.run(
        [str(exe), *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def _pods(kube: KubeCluster, selector: str, namespace: str = NS) -> list[dict[str, Any]]:
    body = kube.rest().get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")
    return list(body["items"])


def _ready(pod: dict[str, Any]) -> bool:
    conds = {c["type"]: c["status"] for c in pod["status"].get("conditions") or ()}
    return conds.get("Ready") == "True" and conds.get("ContainersReady") == "True"


def test_control_plane_boots_with_ready_nodes(kube: KubeCluster) -> None:
    """All four daemons answer; three Nodes are Ready and untainted; the server is 1.20.2."""
    assert kube.timings["total"] < 60, kube.timings
    print("control plane timings (s):", {k: round(v, 2) for k, v in kube.timings.items()})
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.20.2"
    nodes = [n for n in kube.rest().get("/api/v1/nodes")["items"] if n["metadata"]["name"] in NODES]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(NODES)
    for n in nodes:
        conds = {c["type"]: c["status"] for c in n["status"]["conditions"]}
        assert conds["Ready"] == "True"
        assert not n["spec"].get("taints")
    lease = kube.rest().get("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/clu-a")
    assert lease["spec"]["holderIdentity"] == "clu-a"


def test_python_client_and_kopf_stack_authenticate_from_kubeconfig(kube: KubeCluster) -> None:
    """The `kubernetes` client (what the kopf operator uses) lists the nodes via the kubeconfig."""
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(kube.kubeconfig))
    with api_client:
        names = {n.metadata.name for n in client.CoreV1Api(api_client).list_node().items}
    assert names >= set(NODES)  # the session cluster: this module's nodes among them


def test_inference_endpoint_applies_and_prints_columns(kube: KubeCluster) -> None:
    """The rendered InferenceEndpoint is stored unpruned, parses back to the same spec, and
    `kubectl get inferenceendpoints` shows the printer columns with the status we write."""
    manifests = yaml.safe_load_all(
        _preheat("k8s", "render", "--crds", "--namespace", NS, "-f", str(EXAMPLE))
    )
    endpoint = next(m for m in manifests if m["kind"] == "InferenceEndpoint")
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(endpoint))
    stored = kube.rest().get(f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/inferenceendpoints/chat")
    assert stored["spec"] == endpoint["spec"]  # nothing pruned by the structural schema
    spec, _ = endpoint_from_object(stored)
    assert spec == load_endpoint_file(EXAMPLE)[0]

    status = {
        "status": {
            "observedGeneration": stored["metadata"]["generation"],
            "replicas": 2,
            "readyReplicas": 1,
            "warmNodes": 2,
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "ReplicasStarting"},
                {"type": "CacheReady", "status": "True", "reason": "MinReadyNodesWarm"},
            ],
        }
    }
    kube.rest().must(
        "PATCH",
        f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/inferenceendpoints/chat/status",
        status,
        content_type="application/merge-patch+json",
    )
    table = kube.kubectl("get", "inferenceendpoints", "-n", NS).stdout.splitlines()
    header = table[0].split()
    assert header[:8] == [
        "NAME", "READY", "CACHEREADY", "REPLICAS", "AVAILABLE", "WARM", "NODES", "STRATEGY",
    ]  # fmt: skip
    assert table[1].split()[:7] == ["chat", "False", "True", "2", "1", "2", "prefix_aware"]
    assert "chat" in kube.kubectl("get", "preheat", "-n", NS).stdout  # the category lists them too


def test_crd_schema_rejects_out_of_range_fields(kube: KubeCluster) -> None:
    """The API server itself refuses a prefixLength below 1024 and an unknown strategy."""
    body = {
        "apiVersion": "preheat.dev/v1alpha1",
        "kind": "InferenceEndpoint",
        "metadata": {"name": "bad"},
        "spec": {
            "model": {"source": "file:///m"},
            "routing": {"strategy": "fastest", "prefixLength": 100},
        },
    }
    status, out = kube.rest().call(
        "POST", f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/inferenceendpoints", body
    )
    assert status == 422, out
    assert "prefixLength" in out["message"] and "strategy" in out["message"]


def test_every_rendered_manifest_passes_server_dry_run(kube: KubeCluster) -> None:
    """CRDs, RBAC, operator Deployment, agent DaemonSet, router and endpoint all validate."""
    kube.kubectl("create", "namespace", "preheat-system")
    text = _preheat("k8s", "render", "--namespace", NS, "-f", str(EXAMPLE))
    objects = list(yaml.safe_load_all(text))
    out = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=text, timeout=180).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == len(objects), out
    assert all("(server dry run)" in line for line in lines), out
    kinds = {o["kind"] for o in objects}
    assert {"CustomResourceDefinition", "ClusterRole", "Role", "DaemonSet", "Service"} <= kinds


def _engine_deployment(
    name: str, replicas: int, *, affinity_label: str | None, namespace: str = NS
) -> dict[str, Any]:
    labels = {"app": name}
    pod_spec: dict[str, Any] = {
        "containers": [
            {
                "name": "engine",
                "image": "preheat:0.1.0",
                "command": ["preheat"],
                "args": [
                    "engine",
                    "serve",
                    "--host",
                    "$(POD_IP)",
                    "--port",
                    "8000",
                    "--profile",
                    "tiny",
                    "--time-scale",
                    "0",
                    "--model-name",
                    name,
                    "--snapshot",
                    "/models/snap",
                ],
                "env": [
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                ],
                "ports": [{"name": "http", "containerPort": 8000}],
                "readinessProbe": {
                    "httpGet": {"path": "/health", "port": "http"},
                    "periodSeconds": 1,
                },
                "volumeMounts": [{"name": "store", "mountPath": "/models", "readOnly": True}],
            }
        ],
        "volumes": [{"name": "store", "hostPath": {"path": "/var/lib/preheat/store"}}],
        "terminationGracePeriodSeconds": 5,
    }
    if affinity_label:
        key, value = affinity_label.split("=")
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "preference": {
                            "matchExpressions": [{"key": key, "operator": "In", "values": [value]}]
                        },
                    }
                ]
            }
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


@pytest.fixture(scope="module")
def engines(kube: KubeCluster) -> Iterator[list[dict[str, Any]]]:
    """A Deployment of four `preheat engine serve` pods with preferred affinity for pool=gpu,
    a Service over them, all Ready; each node's store holds the snapshot the pods read."""
    for name in NODES:
        snap = kube.root / "nodes" / name / "var/lib/preheat/store/snap"
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "weights.bin").write_bytes(name.encode() * 1000)
    deployment = _engine_deployment("engines", 4, affinity_label="pool=gpu")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "engines", "namespace": NS},
        "spec": {"selector": {"app": "engines"}, "ports": [{"name": "http", "port": 8000}]},
    }
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([deployment, service]))

    def available() -> list[dict[str, Any]] | None:
        pods = _pods(kube, "app=engines")
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live if len(live) == 4 and all(_ready(p) for p in live) else None

    yield kube.wait_for("4 engine pods Ready", available, timeout=90)
    kube.kubectl("delete", "-n", NS, "deployment/engines", "service/engines", "--wait=false")


def test_deployment_pods_run_on_loopback_ips_and_prefer_labelled_nodes(
    kube: KubeCluster, engines: list[dict[str, Any]]
) -> None:
    """The real controller-manager and scheduler run the Deployment: every pod has its own
    127.x address, answers there, and the preferred affinity kept them on pool=gpu nodes."""
    ips = [p["status"]["podIP"] for p in engines]
    assert len(set(ips)) == 4 and all(ip.startswith("127.") for ip in ips)
    assert {p["spec"]["nodeName"] for p in engines} <= {"clu-a", "clu-b"}
    # the controller-manager writes the Deployment's status a moment after the pods turn
    # Ready (asynchronously), so wait for it rather than read it once
    kube.wait_for(
        "the Deployment reports 4 available replicas",
        lambda: (
            kube.rest()
            .get(f"/apis/apps/v1/namespaces/{NS}/deployments/engines")
            .get("status", {})
            .get("availableReplicas")
            == 4
        ),
        timeout=30,
    )
    for ip in ips:
        with urllib.request.urlopen(f"http://{ip}:8000/health", timeout=5) as r:
            assert r.status == 200
    # Steady state: no status churn (lastTransitionTime moves only when a condition does).
    name = engines[0]["metadata"]["name"]
    before = kube.rest().get(f"/api/v1/namespaces/{NS}/pods/{name}")["metadata"]
    time.sleep(1.5)
    after = kube.rest().get(f"/api/v1/namespaces/{NS}/pods/{name}")["metadata"]
    assert after["resourceVersion"] == before["resourceVersion"]


def test_endpointslices_list_pod_ips_and_a_pod_serves_a_completion(
    kube: KubeCluster, engines: list[dict[str, Any]]
) -> None:
    """discovery.k8s.io/v1beta1 EndpointSlices hold the Ready pod IPs; one of them answers
    /v1/completions with generated tokens."""
    ips = {p["status"]["podIP"] for p in engines}

    def sliced() -> set[str] | None:
        body = kube.rest().get(
            f"/apis/discovery.k8s.io/v1beta1/namespaces/{NS}/endpointslices"
            "?labelSelector=kubernetes.io/service-name=engines"
        )
        found = {
            addr
            for s in body["items"]
            for e in s.get("endpoints") or ()
            if (e.get("conditions") or {}).get("ready")
            for addr in e["addresses"]
        }
        return found if found == ips else None

    kube.wait_for("EndpointSlices list the 4 pod IPs", sliced, timeout=30)
    ip = sorted(ips)[0]
    req = urllib.request.Request(
        f"http://{ip}:8000/v1/completions",
        data=json.dumps({"model": "engines", "prompt": "Hello there", "max_tokens": 5}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        body = json.loads(r.read())
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["text"]


def test_crashed_container_is_restarted_and_ready_again(
    kube: KubeCluster, engines: list[dict[str, Any]]
) -> None:
    """Killing a pod's process makes the stand-in restart it (restartPolicy Always): the
    restart count goes to 1 and the pod is Ready again on the same IP."""
    pod = engines[0]
    name = pod["metadata"]["name"]
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("standin://"))
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        p = kube.rest().get(f"/api/v1/namespaces/{NS}/pods/{name}")
        cs = p["status"]["containerStatuses"][0]
        return p if cs["restartCount"] == 1 and _ready(p) else None

    after = kube.wait_for("the killed engine restarted and Ready", restarted, timeout=60)
    assert after["status"]["podIP"] == pod["status"]["podIP"]
    with urllib.request.urlopen(f"http://{after['status']['podIP']}:8000/health", timeout=5) as r:
        assert r.status == 200


def test_scale_in_deletes_pods_and_stops_their_processes(
    kube: KubeCluster, engines: list[dict[str, Any]]
) -> None:
    """Scaling to 2 ends two pods: the stand-in stops their processes and finishes the
    deletion, so the Pod objects disappear and their addresses stop answering."""
    kube.kubectl("scale", "-n", NS, "deployment/engines", "--replicas=2")

    def two_left() -> list[dict[str, Any]] | None:
        pods = _pods(kube, "app=engines")
        return pods if len(pods) == 2 else None

    left = kube.wait_for("two engine pods left", two_left, timeout=60)
    gone = {p["status"]["podIP"] for p in engines} - {p["status"]["podIP"] for p in left}
    assert len(gone) == 2
    for ip in gone:
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{ip}:8000/health", timeout=2)


def _apply_roles(kube: KubeCluster) -> None:
    spec, pod = load_endpoint_file(EXAMPLE)
    rbac = [
        o
        for o in system_manifests() + endpoint_manifests(spec, namespace=NS, pod=pod)
        if o["kind"]
        in {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    ]
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))


def test_rendered_agent_and_router_roles_allow_their_verbs_and_refuse_others(
    kube: KubeCluster,
) -> None:
    """With exactly the rendered RBAC, the agent can list pods and write its NodeCache and
    its status, the router can list EndpointSlices in its namespace; a verb outside the
    Roles (deleting a pod, writing a ModelDataCache, reading slices elsewhere) gets 403."""
    status, _ = kube.rest().call("GET", "/api/v1/namespaces/preheat-system")
    if status == 404:
        kube.kubectl("create", "namespace", "preheat-system")
    _apply_roles(kube)
    agent = kube.rest(kube.service_account_token("preheat-system", "preheat-agent"))
    router = kube.rest(kube.service_account_token(NS, "preheat-router-chat"))
    nodecache = {
        "apiVersion": "preheat.dev/v1alpha1",
        "kind": "NodeCache",
        "metadata": {"name": "clu-a"},
        "spec": {"node": "clu-a", "storePath": "/var/lib/preheat/store"},
    }

    def expect(client: Any, code: int, method: str, path: str, body: Any = None, **kw: Any) -> None:
        deadline = time.monotonic() + 10  # RBAC caches settle within a second or two
        while True:
            got, out = client.call(method, path, body, **kw)
            if got == code or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == code, f"{method} {path}: {got} {out}"

    expect(agent, 200, "GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dclu-a")
    expect(agent, 201, "POST", "/apis/preheat.dev/v1alpha1/nodecaches", nodecache)
    expect(
        agent, 200, "PATCH", "/apis/preheat.dev/v1alpha1/nodecaches/clu-a/status",
        {"status": {"freeBytes": 10, "revisionCount": 0}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    expect(agent, 200, "GET", "/apis/preheat.dev/v1alpha1/modeldatacaches")
    expect(agent, 200, "GET", "/api/v1/nodes/clu-a")
    expect(agent, 403, "DELETE", f"/api/v1/namespaces/{NS}/pods/whatever")
    expect(
        agent, 403, "POST", f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/modeldatacaches",
        {"apiVersion": "preheat.dev/v1alpha1", "kind": "ModelDataCache",
         "metadata": {"name": "x"}, "spec": {"source": "file:///m"}},
    )  # fmt: skip
    expect(agent, 403, "GET", f"/api/v1/namespaces/{NS}/secrets")
    expect(router, 200, "GET", f"/apis/discovery.k8s.io/v1beta1/namespaces/{NS}/endpointslices")
    expect(router, 200, "GET", f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/inferenceendpoints")
    expect(
        router, 403, "GET", "/apis/discovery.k8s.io/v1beta1/namespaces/kube-system/endpointslices"
    )
    expect(router, 403, "GET", f"/api/v1/namespaces/{NS}/pods")
    # The rules under test are the ones the code renders, not a copy.
    assert any("nodecaches/status" in r["resources"] for r in AGENT_RULES)
    assert all("delete" not in r["verbs"] for r in ROUTER_RULES)


def test_init_container_output_reaches_the_main_container_and_pod_succeeds(
    kube: KubeCluster,
) -> None:
    """An init container writes into an emptyDir that the main container then reads; with
    restartPolicy Never the pod ends Succeeded, with Initialized=True (the shape the
    operator's cold-node init step will use)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "init-demo", "namespace": NS},
        "spec": {
            "restartPolicy": "Never",
            "nodeName": "clu-c",
            "initContainers": [
                {
                    "name": "fetch",
                    "image": "busybox",
                    "command": ["sh", "-c", "echo warm > /work/marker"],
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "command": ["sh", "-c", 'test "$(cat /work/marker)" = warm && echo "$NODE"'],
                    "env": [
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
                    ],
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                }
            ],
            "volumes": [{"name": "work", "emptyDir": {}}],
        },
    }
    kube.rest().must("POST", f"/api/v1/namespaces/{NS}/pods", pod)

    def finished() -> dict[str, Any] | None:
        p = kube.rest().get(f"/api/v1/namespaces/{NS}/pods/init-demo")
        return p if p["status"].get("phase") in ("Succeeded", "Failed") else None

    done = kube.wait_for("init-demo finished", finished, timeout=30)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    conds = {c["type"]: c["status"] for c in done["status"]["conditions"]}
    assert conds["Initialized"] == "True"
    main = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert main["exitCode"] == 0
    kube.kubectl("delete", "-n", NS, "pod", "init-demo", "--wait=true", "--timeout=30s")
