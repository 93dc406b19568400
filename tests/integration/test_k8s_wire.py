"""Kubernetes-mode wiring on a real v1.20.2 control plane: engine pods that fill from the
agents' peers, the kv-event ports of a variant's Service, and an agent that writes
containerd's hosts.toml.

Two stand-in nodes: wire-a (pool=warm) runs one `preheat agent` with peers, the node
mirror and `--containerd-hosts-dir`; wire-b (pool=cold) runs no agent and holds nothing.
The operator runs as a real process with the rendered `preheat-operator` ServiceAccount
(its settings Role included), the `preheat-settings` ConfigMap is the rendered one (peers
on). The endpoint's pods are pinned to wire-b (`pod.nodeSelector`), so its pod is cold; its
init container reads NodeCaches as the `default` ServiceAccount bound by the rendered
`preheat-engine-k8s-wire-chat` ClusterRoleBinding (the kubelet stand-in mounts no
ServiceAccount token, so `pod.env` hands snapshot-init a kubeconfig holding that
account's token: the same identity a real pod gets). nginx's access log counts the
origin's bytes; docker-registry's access log counts the registry's requests.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from preheat.bench.models import generate_model, write_http_manifest
from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.agent_containerd import MARK
from preheat.runtime.kubernetes.discovery_slices import kv_event_endpoints
from preheat.runtime.kubernetes.render import endpoint_manifests, system_manifests
from preheat.runtime.kubernetes.resources import PodOverrides, endpoint_object
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.testing.containerd import containerd
from preheat.testing.kube import (
    KubeCluster,
    write_kubeconfig,
)
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import nginx_origin, origin_bytes_sent
from preheat.testing.procs import Process, free_port
from preheat.testing.registry import Registry, registry, write_layout
from tests.integration.test_k8s_peers import PeerAgent

pytestmark = pytest.mark.kubernetes

API = "/apis/preheat.dev/v1alpha1"
NS = "k8s-wire"
NS_API = f"{API}/namespaces/{NS}"
SIZE = 4_000_000
KV_PORT, REPLAY_PORT = 6557, 6558
ENGINE = (
    "preheat engine serve --host {host} --port {port} --profile tiny --snapshot {snapshot} "
    "--time-scale 0.05 --model-name {model} "
    f"--kv-events tcp://{{host}}:{KV_PORT}?replay=tcp://{{host}}:{REPLAY_PORT}"
)


class WireAgent(PeerAgent):
    """wire-a's agent: peers, the node mirror and containerd's hosts.toml files."""

    def __init__(self, *a: Any, hosts_dir: Path, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.hosts_dir = hosts_dir
        self.mirror_port = free_port()

    def argv(self) -> list[str]:
        return [
            *super().argv(), "--mirror-port", str(self.mirror_port),
            "--containerd-hosts-dir", str(self.hosts_dir),
        ]  # fmt: skip


@dataclass
class World:
    kube: KubeCluster
    base: Path
    access_log: Path
    url: str
    token: str
    agent: WireAgent
    operator: Process
    reg: Registry


def _kubeconfig(kube: KubeCluster, path: Path, namespace: str, name: str) -> Path:
    token = kube.service_account_token(namespace, name)
    return write_kubeconfig(path, server=kube.server, ca_file=kube.ca_file, token=token, user=name)


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The session cluster's share (wire-a warm, wire-b cold), nginx origin, registry, the
    rendered RBAC and settings, the peer token Secret in both namespaces, wire-a's agent and
    the operator."""
    base = tmp_path_factory.mktemp("k8s-wire")
    generate_model(base / "origin" / "m", SIZE, shards=2, seed=21)
    write_http_manifest(base / "origin" / "m")
    token = secrets.token_urlsafe(32)
    (base / "peer-token").write_text(token + "\n")
    log = base / "access.log"
    nodes = {"wire-a": {"pool": "warm"}, "wire-b": {"pool": "cold"}}
    with (
        kube_share(kube_session, namespaces=[NS], nodes=nodes) as kube,
        nginx_origin(base / "origin", access_log=log) as origin,
        registry(base / "reg") as reg,
    ):
        kinds = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                 "RoleBinding", "ConfigMap"}  # fmt: skip
        spec = parse_endpoint({"name": "chat", "model": {"source": "file:///m"}}, origin="t")
        engine_rb = [
            o for o in endpoint_manifests(spec, namespace=NS) if o["kind"] == "ClusterRoleBinding"
        ]
        rbac = [m for m in system_manifests() if m["kind"] in kinds] + engine_rb
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
        for ns in ("preheat-system", NS):
            kube.kubectl("create", "secret", "generic", "preheat-peer-token", "-n", ns,
                         f"--from-file=token={base / 'peer-token'}")  # fmt: skip
        agent_conf = _kubeconfig(kube, base / "agent.kubeconfig", "preheat-system", "preheat-agent")
        store = kube.root / "nodes" / "wire-a" / "var/lib/preheat/store"
        agent = WireAgent(
            "wire-a", store, agent_conf, base / "agent.log", base / "peer-token",
            hosts_dir=base / "certs.d",
        )  # fmt: skip
        op_conf = _kubeconfig(kube, base / "op.kubeconfig", "preheat-system", "preheat-operator")
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        operator = start_process(
            [str(Path(sys.executable).parent / "preheat"), "operator", "--kubeconfig",
             str(op_conf), "--namespace", NS, "--metrics-port", str(free_port()),
             "--tick", "1"],
            base / "operator.log", env=env, inherit_env=False,
        )  # fmt: skip
        # chat-main as an operator before kv-event ports made it: http only
        old = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "chat-main"},
               "spec": {"selector": {"preheat.dev/endpoint": "chat"},
                        "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}  # fmt: skip
        kube.rest().must("POST", f"/api/v1/namespaces/{NS}/services", old)
        try:
            agent.start()
            url = origin.url("m/preheat-manifest.json")
            yield World(kube, base, log, url, token, agent, operator, reg)
        finally:  # both at once: each may take seconds to exit on a loaded machine
            stops = [threading.Thread(target=operator.stop, args=(10,)),
                     threading.Thread(target=agent.stop)]  # fmt: skip
            for t in stops:
                t.start()
            for t in stops:
                t.join()


def _endpoint(world: World) -> dict[str, Any]:
    spec = parse_endpoint(
        {
            "name": "chat",
            "model": {"source": world.url},
            "engine": {"command": ENGINE},
            "replicas": {"min": 1, "max": 2},
            "modelCacheConfig": {
                "weights": {"enabled": True, "nodes": {"selector": {"pool": "warm"}},
                            "minReady": 1, "timeoutSeconds": 120},
            },
        },
        origin="test",
    )  # fmt: skip
    # no kubeconfig handed in: snapshot-init uses the pod's ServiceAccount credentials,
    # which the kubelet stand-in gives it as the kubelet would (kubelet_volumes)
    pod = PodOverrides(node_selector=(("pool", "cold"),))
    return endpoint_object(spec, namespace=NS, pod=pod)


def _ready_pod(world: World) -> dict[str, Any] | None:
    items = world.kube.rest().get(
        f"/api/v1/namespaces/{NS}/pods?labelSelector=preheat.dev/endpoint%3Dchat"
    )["items"]
    for p in items:
        conds = {c["type"]: c["status"] for c in (p.get("status") or {}).get("conditions") or ()}
        if conds.get("Ready") == "True" and not p["metadata"].get("deletionTimestamp"):
            return dict(p)
    return None


def test_a_cold_node_pod_fills_from_the_peer_agent_not_the_origin(world: World) -> None:
    """With the rendered settings (peers on) the operator gives snapshot-init the token
    Secret and --peers-from-nodecaches; the pod on wire-b (no agent, empty store) takes
    every model byte from wire-a's agent, the origin sends the model once (wire-a's
    warm-up) and the token is in no log."""
    kube = world.kube
    revision, manifest = NodeStore(world.base / "probe").resolve(world.url)
    size = sum(f.size for f in manifest.files)
    before = origin_bytes_sent(world.access_log)
    kube.rest().must("POST", f"{NS_API}/inferenceendpoints", _endpoint(world))
    pod = until("a Ready engine pod", lambda: _ready_pod(world), timeout=150)
    assert pod["spec"]["nodeName"] == "wire-b"
    (init,) = pod["spec"]["initContainers"]
    assert "--peers-from-nodecaches" in init["args"]
    logs = list((kube.root / "nodes" / "wire-b" / "pods").glob(f"{NS}_{pod['metadata']['name']}_*/snapshot.log"))  # fmt: skip
    assert len(logs) == 1, logs
    out = json.loads(logs[0].read_text().strip().splitlines()[-1])
    assert not out["warm"] and out["bytes_from"] == {"peer": size}, out
    sent = origin_bytes_sent(world.access_log) - before
    assert size <= sent <= size + (64 << 10), f"origin sent {sent} B for a {size} B model"
    status = kube.rest().get(f"{API}/nodecaches/wire-a")["status"]
    assert any(r["revision"] == revision and r["state"] == "Ready" for r in status["revisions"])
    print(f"\nk8s wire: cold pod {out['bytes_from']}, origin sent {sent} B for {size} B")
    for text in (logs[0].read_text(), world.agent.log.read_text()):
        assert world.token not in text


def test_the_variant_services_slices_carry_the_engines_kv_event_ports(world: World) -> None:
    """The engine template publishes KV events, so the operator gives the Service
    chat-main (made before, with http only) ports kv-events/kv-replay; the real
    EndpointSlice controller copies them with the pod's address, and discovery's reading
    gives the router tcp://POD_IP:PORT with replay."""
    pod = until("a Ready engine pod", lambda: _ready_pod(world), timeout=150)
    svc = world.kube.rest().get(f"/api/v1/namespaces/{NS}/services/chat-main")
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http", "kv-events", "kv-replay"]
    ip = pod["status"]["podIP"]
    want = f"tcp://{ip}:{KV_PORT}?replay=tcp://{ip}:{REPLAY_PORT}"

    def seen() -> dict[str, str] | None:
        slices = world.kube.rest().get(
            f"/apis/discovery.k8s.io/v1beta1/namespaces/{NS}/endpointslices"
            "?labelSelector=kubernetes.io/service-name%3Dchat-main"
        )["items"]
        got = kv_event_endpoints(slices, {"chat-main": "main"})
        return got if got.get(f"http://{ip}:8000") == want else None

    until("kv-event ports in the slice", seen, timeout=60)


def test_the_agent_writes_containerds_hosts_file_and_ctr_pulls_through_it(
    world: World,
) -> None:
    """A ModelImageCache on wire-a makes its agent pre-pull the image and write
    <hosts dir>/<registry>/hosts.toml (mirror_config's content); `ctr images pull
    --hosts-dir` then takes the image from the mirror with 0 registry requests; deleting
    the cache removes the agent's file."""
    reg, kube = world.reg, world.kube
    layout = write_layout(world.base / "img", [1 << 20, 1000], seed=3)
    reg.push(layout.path, "team/app:v1")
    body = {
        "apiVersion": "preheat.dev/v1alpha1",
        "kind": "ModelImageCache",
        "metadata": {"name": "app-wire"},
        "spec": {"image": reg.ref("team/app:v1"), "nodes": {"names": ["wire-a"]},
                 "endpoints": ["chat"]},
    }  # fmt: skip
    kube.rest().must("POST", f"{NS_API}/modelimagecaches", body)
    hosts = world.agent.hosts_dir / reg.host / "hosts.toml"

    def pulled() -> bool:
        status = kube.rest().get(f"{API}/nodecaches/wire-a").get("status") or {}
        return any(i.get("state") == "Ready" for i in status.get("images") or ())

    until("image pre-pulled", pulled, timeout=60)
    until("hosts.toml written", hosts.exists, timeout=30)
    text = hosts.read_text()
    assert text.startswith(MARK) and f"http://127.0.0.1:{world.agent.mirror_port}" in text
    with containerd(world.base / "ctd") as ctd:
        before = len(reg.requests())
        ctd.ctr("images", "pull", "--hosts-dir", str(world.agent.hosts_dir), "--snapshotter",
                "native", "--platform", "linux/amd64", reg.ref("team/app:v1"))  # fmt: skip
        assert reg.requests()[before:] == []
        assert layout.images["linux/amd64"].manifest in ctd.ctr("images", "ls").stdout
    kube.rest().must("DELETE", f"{NS_API}/modelimagecaches/app-wire")
    until("hosts.toml removed", lambda: not hosts.exists(), timeout=30)


_WHOAMI = """
import json, pathlib, ssl, sys, urllib.request, urllib.error
import yaml
conf = yaml.safe_load(open(__import__("os").environ["KUBECONFIG"]))
server = conf["clusters"][0]["cluster"]["server"]
ctx = ssl.create_default_context(cadata=None)
ctx.load_verify_locations(cafile=sys.argv[1] + "/ca.crt")
def get(path, token):
    req = urllib.request.Request(server + path, headers={"Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()).get("message", "")
sa = conf["users"][0]["user"]["token"]
projected = pathlib.Path(sys.argv[2], "tok").read_text()
print(json.dumps({
    "nodecaches": get("/apis/preheat.dev/v1alpha1/nodecaches", sa)[0],
    "pods": get("/api/v1/namespaces/k8s-wire/pods", sa),
    "projected": get("/api/v1/namespaces/k8s-wire/pods", projected),
    "optional": sorted(p.name for p in pathlib.Path(sys.argv[3]).iterdir()),
}))
"""


def test_the_stand_in_gives_pods_their_service_account_and_optional_secrets(
    world: World,
) -> None:
    """A pod on wire-b with the admission's ServiceAccount volume, a projected token and an
    optional Secret that does not exist runs (phase Succeeded): it reaches the API as
    system:serviceaccount:k8s-wire:default through the KUBECONFIG the stand-in wrote
    (NodeCaches allowed by the engine binding, pods forbidden), the TokenRequest token
    acts as the same ServiceAccount, and the optional volume is an empty directory."""
    sa_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "whoami"},
        "spec": {
            "nodeName": "wire-b", "restartPolicy": "Never",
            "containers": [{
                "name": "c", "image": "none",
                "command": [sys.executable, "-c", _WHOAMI, sa_dir, "/tokens", "/absent"],
                "volumeMounts": [{"name": "tok", "mountPath": "/tokens"},
                                 {"name": "absent", "mountPath": "/absent"}],
            }],
            "volumes": [
                {"name": "tok", "projected": {"sources": [{"serviceAccountToken": {
                    "path": "tok", "expirationSeconds": 600}}]}},
                {"name": "absent", "secret": {"secretName": "no-such", "optional": True}},
            ],
        },
    }  # fmt: skip
    rest = world.kube.rest()
    rest.must("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    try:
        phase = until(
            "the pod finished",
            lambda: (
                (rest.get(f"/api/v1/namespaces/{NS}/pods/whoami").get("status") or {}).get("phase")
                in ("Succeeded", "Failed")
                and rest.get(f"/api/v1/namespaces/{NS}/pods/whoami")["status"]["phase"]
            ),
            timeout=60,
        )
        (log,) = (world.kube.root / "nodes" / "wire-b" / "pods").glob(f"{NS}_whoami_*/c.log")
        text = log.read_text()
        assert phase == "Succeeded", text
        out = json.loads(text.strip().splitlines()[-1])
        user = f"system:serviceaccount:{NS}:default"
        assert out["nodecaches"] == 200, out
        assert out["pods"][0] == 403 and user in out["pods"][1], out
        assert out["projected"][0] == 403 and user in out["projected"][1], out
        assert out["optional"] == [], out
    finally:
        rest.call("DELETE", f"/api/v1/namespaces/{NS}/pods/whoami?gracePeriodSeconds=0")
