"""An ``hf://`` endpoint in Kubernetes mode, end to end on a real v1.20.2 control plane.

A **private** repo on the test Hub (``preheat.testing.hub``), readable only with one
token. The token reaches preheat as docs/kubernetes.md ("Origin credentials") tells users
to hand it over: the Secret ``preheat-origin-credentials`` in preheat-system
(``HF_TOKEN``, ``HF_ENDPOINT``) that the rendered operator Deployment and agent DaemonSet
take with ``envFrom`` (here the operator and the two agents run as processes, so they get
that Secret's keys, read from the API, as their environment: what the kubelet would
give the rendered containers), and a Secret in the endpoint's namespace named by
``pod.env`` (``secretKeyRef``) for the engine pod, which the kubelet stand-in resolves.

Two stand-in nodes (hfk-a, hfk-b), one peer-serving agent on each, the rendered RBAC and
``preheat-settings`` (peers on, no origin budget set), the operator with its rendered
ServiceAccount. The Hub's access log counts every body byte it sends.
"""

from __future__ import annotations

import base64
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

from preheat.bench.models import generate_model
from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.render import (
    ORIGIN_CREDENTIALS_SECRET,
    endpoint_manifests,
    system_manifests,
)
from preheat.runtime.kubernetes.resources import PodOverrides, endpoint_object
from preheat.runtime.procs import start_process
from preheat.testing.hub import HubRepos, HubServer, hub_server
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.procs import Process, free_port
from tests.integration.test_k8s_agent import _nodecache
from tests.integration.test_k8s_peers import PeerAgent

pytestmark = pytest.mark.kubernetes

API = "/apis/preheat.dev/v1alpha1"
NS = "k8s-hf"
NS_API = f"{API}/namespaces/{NS}"
NODES = ("hfk-a", "hfk-b")
PREHEAT = str(Path(sys.executable).parent / "preheat")
REPO = "acme/private"
SIZE = 4_000_000  # two LFS shards of 2 MB, plus the index and config.json (git files)
ENGINE = (
    "preheat engine serve --host {host} --port {port} --profile tiny --snapshot {snapshot} "
    "--time-scale 0.05 --model-name {model}"
)

ENDPOINT = """
name: chat
model: {{source: "hf://{repo}"}}
engine: {{command: "{engine}"}}
replicas: {{min: 1, max: 1}}
modelCacheConfig:
  weights: {{enabled: true, nodes: {{selector: {{pool: hfk}}}}, minReady: 2, timeoutSeconds: 120}}
"""


class HfAgent(PeerAgent):
    """An agent whose environment is the origin credentials Secret's keys."""

    def __init__(self, *a: Any, env: dict[str, str], **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.extra_env = env

    def start(self) -> None:
        self.proc = start_process(self.argv(), self.log, env=self.extra_env, inherit_env=False)
        until(f"agent {self.node} serving", lambda: self.get("/inventory"))


@dataclass
class World:
    kube: KubeCluster
    base: Path
    hub: HubServer
    sha: str
    size: int
    token: str
    agents: dict[str, HfAgent]
    operator: Process


def _secret(kube: KubeCluster, namespace: str, name: str, data: dict[str, str]) -> None:
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
            "type": "Opaque", "stringData": data}  # fmt: skip
    kube.rest().must("POST", f"/api/v1/namespaces/{namespace}/secrets", body)


def _env_from_secret(kube: KubeCluster, namespace: str, name: str, home: Path) -> dict[str, str]:
    """This process's environment (no kubeconfig, no Hugging Face settings of its own)
    plus every key of the Secret, as ``envFrom`` gives a container."""
    data = kube.rest().get(f"/api/v1/namespaces/{namespace}/secrets/{name}")["data"]
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("HF_")}
    env["HF_HOME"] = str(home)  # no token file of the machine's user is read
    env.update({k: base64.b64decode(v).decode() for k, v in data.items()})
    return env


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """This module's share of the session cluster, a private repo on the test Hub, the
    origin credentials Secret, the rendered RBAC and settings, two agents, the operator."""
    base = tmp_path_factory.mktemp("k8s-hf")
    files = generate_model(base / "model", SIZE, shards=2, seed=12)
    repos = HubRepos(base / "hub")
    token = "hf_" + secrets.token_urlsafe(24)
    repos.add_token(token, "alice")
    repos.create(REPO, private=True, readers=("alice",))
    sha = repos.commit(REPO, {p.name: p for p in files})
    size = sum(p.stat().st_size for p in files)
    token_file = base / "peer-token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    nodes = {n: {"pool": "hfk"} for n in NODES}
    with (
        kube_share(kube_session, namespaces=[NS], nodes=nodes) as kube,
        hub_server(repos.root) as hub,
    ):
        kinds = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                 "RoleBinding", "ConfigMap"}  # fmt: skip
        engine_rb = [
            o
            for o in endpoint_manifests(_spec(), namespace=NS)
            if o["kind"] == "ClusterRoleBinding"
        ]
        rbac = [m for m in system_manifests() if m["kind"] in kinds] + engine_rb
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
        creds = {"HF_TOKEN": token, "HF_ENDPOINT": hub.url}
        _secret(kube, "preheat-system", ORIGIN_CREDENTIALS_SECRET, creds)
        _secret(kube, NS, "hf-token", {"HF_TOKEN": token})
        env = _env_from_secret(kube, "preheat-system", ORIGIN_CREDENTIALS_SECRET, base / "hf")
        conf = kube.sa_kubeconfig(base / "agent.kubeconfig", "preheat-system", "preheat-agent")
        stores = {n: kube.root / "nodes" / n / "var/lib/preheat/store" for n in NODES}
        agents = {
            n: HfAgent(n, stores[n], conf, base / f"{n}.log", token_file, env=env) for n in NODES
        }
        op_conf = kube.sa_kubeconfig(base / "op.kubeconfig", "preheat-system", "preheat-operator")
        flags = {"--kubeconfig": op_conf, "--namespace": NS, "--tick": 1,
                 "--metrics-port": free_port()}  # fmt: skip
        argv = [PREHEAT, "operator", *(str(x) for kv in flags.items() for x in kv)]
        operator = start_process(argv, base / "operator.log", env=env, inherit_env=False)
        try:
            for a in agents.values():
                a.start()
            yield World(kube, base, hub, sha, size, token, agents, operator)
        finally:  # all at once: each may take seconds to exit on a loaded machine
            stops = [threading.Thread(target=operator.stop, args=(10,))]
            stops += [threading.Thread(target=a.stop) for a in agents.values()]
            for t in stops:
                t.start()
            for t in stops:
                t.join()


def _spec() -> Any:
    """The endpoint of docs/kubernetes.md's example, with the simulated engine."""
    return parse_endpoint(yaml.safe_load(ENDPOINT.format(repo=REPO, engine=ENGINE)), origin="t")


def _ready_pod(kube: KubeCluster) -> dict[str, Any] | None:
    """The endpoint's pod whose containers are all ready, if there is one."""
    query = "labelSelector=preheat.dev/endpoint%3Dchat&fieldSelector=status.phase%3DRunning"
    for p in kube.rest().get(f"/api/v1/namespaces/{NS}/pods?{query}")["items"]:
        statuses = (p.get("status") or {}).get("containerStatuses") or [{}]
        if all(c.get("ready") for c in statuses) and not p["metadata"].get("deletionTimestamp"):
            return dict(p)
    return None


def _warmed(kube: KubeCluster, node: str, revision: str) -> dict[str, Any] | None:
    status = _nodecache(kube, node).get("status") or {}
    found = [w for w in status.get("warmups") or () if w["revision"] == revision]
    ready = any(
        r["revision"] == revision and r["state"] == "Ready" for r in status.get("revisions") or ()
    )
    return found[-1] if ready and found else None


def test_a_private_hf_endpoint_warms_two_nodes_from_one_copy_and_starts_from_the_snapshot(
    world: World,
) -> None:
    """The operator resolves hf://acme/private with the Secret's token to its commit, both
    agents warm hf:<sha> (one copy from the Hub, the rest from the peer), the engine pod
    (HF_TOKEN from a secretKeyRef) starts from its node's snapshot with 0 bytes fetched,
    and the token is in no status, Event, pod log or process log."""
    kube, revision = world.kube, f"hf:{world.sha}"
    pod = PodOverrides(
        env=({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                                 "key": "HF_TOKEN"}}},),
    )  # fmt: skip
    kube.rest().must(
        "POST", f"{NS_API}/inferenceendpoints", endpoint_object(_spec(), namespace=NS, pod=pod)
    )
    warmups = {
        n: until(f"{n} holds {revision}", lambda n=n: _warmed(kube, n, revision), timeout=90)
        for n in NODES
    }
    ready = until("a Ready engine pod", lambda: _ready_pod(kube), timeout=120)
    # the Hub served the repo only to the token, and about one copy of it
    asked = [r for h in ("hub", "storage") for r in world.hub.requests(h) if r[1] != "/health"]
    sent = [r for r in asked if r[0] == "GET"]
    assert sent and all(r[4] == "token" for r in world.hub.requests("hub") if r in asked), sent
    origin = sum(r[3] for r in sent)
    peer = sum(w["bytesFrom"].get("peer", 0) for w in warmups.values())
    assert world.size <= origin <= 1.10 * world.size, (origin, world.size, warmups)
    assert peer >= 0.9 * world.size, warmups
    # the pod runs the revision from its node's store
    node = ready["spec"]["nodeName"]
    assert node in NODES
    assert ready["metadata"]["annotations"]["preheat.dev/revision"] == revision
    pod_dir = kube.root / "nodes" / node / "pods"
    (log,) = pod_dir.glob(f"{NS}_{ready['metadata']['name']}_*/snapshot.log")
    out = json.loads(log.read_text().strip().splitlines()[-1])
    assert out["warm"] and out["bytes_fetched"] == 0, out
    assert out["bytes_from"] == {"cache": world.size}, out
    print(f"\nk8s hf: Hub sent {origin} B for {world.size} B ({origin / world.size:.4f}x); "
          f"peers {peer} B; warm-ups {json.dumps(warmups, sort_keys=True)}")  # fmt: skip
    # the token is nowhere a user (or another tenant) reads
    rest = kube.rest()
    readable = [rest.get(f"{API}/nodecaches/{n}") for n in NODES] + [
        rest.get(f"{NS_API}/inferenceendpoints/chat"),
        rest.get(f"{NS_API}/modeldatacaches"),
        rest.get(f"/api/v1/namespaces/{NS}/events"),
        rest.get("/api/v1/namespaces/preheat-system/events"),
        rest.get(f"/apis/apps/v1/namespaces/{NS}/deployments"),
        rest.get(f"/api/v1/namespaces/{NS}/pods"),
    ]
    text = json.dumps(readable)
    assert revision in text and world.token not in text
    logs = [p.read_text() for p in log.parent.glob("*.log")]
    logs += [a.log.read_text() for a in world.agents.values()]
    logs.append((world.base / "operator.log").read_text())
    assert len(logs) >= 5 and not [t for t in logs if world.token in t]
