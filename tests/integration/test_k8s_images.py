"""The image cache in Kubernetes mode on a real v1.20.2 control plane.

Two stand-in nodes (pool=gpu), one `preheat agent` per node with its node mirror
(`--mirror-port`, upstream the registry), the operator as a real process with the rendered
RBAC, and Debian's docker-registry holding the engine image. An endpoint with
`modelCacheConfig.image.enabled` gets one ModelImageCache; the agents pre-pull the image
into their node stores, reference it for the endpoint and report it; the operator
aggregates the nodes' rows into the ModelImageCache status. The kubelet stand-in runs the
engine as a local process: it never pulls an image, so what a container runtime would
pull is shown by skopeo pulling through an agent's mirror.

The tests run in order and share the cluster.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import config as kube_config

from preheat.bench.models import generate_model, write_http_manifest
from preheat.control.spec import parse_endpoint
from preheat.images import ImageCache
from preheat.runtime.kubernetes.podrecords import PodStartRecorder
from preheat.runtime.kubernetes.render import system_manifests
from preheat.runtime.kubernetes.resources import endpoint_object
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import nginx_origin
from preheat.testing.procs import Process, free_port
from preheat.testing.registry import OciLayout, Registry, registry, skopeo, write_layout

pytestmark = pytest.mark.kubernetes

NS = "k8s-images"
NODES = ("img-a", "img-b")
API = "/apis/preheat.dev/v1alpha1"
NS_API = f"{API}/namespaces/{NS}"
MiB = 1 << 20


@dataclass
class World:
    kube: KubeCluster
    reg: Registry
    layout: OciLayout
    image: str
    model: str
    base: Path
    mirror_ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)

    def get(self, path: str) -> Any:
        return self.kube.rest().get(path)

    def store(self, node: str) -> Path:
        return self.kube.root / "nodes" / node / "var/lib/preheat/store"

    def image_row(self, node: str, image: str | None = None) -> dict[str, Any]:
        key = image or self.image
        rows = (self.get(f"{API}/nodecaches/{node}").get("status") or {}).get("images") or ()
        return next((dict(r) for r in rows if r["image"] == key), {})

    def image_cache(self, image: str | None = None) -> dict[str, Any]:
        items = self.get(f"{NS_API}/modelimagecaches")["items"]
        return next((dict(o) for o in items if o["spec"]["image"] == (image or self.image)), {})

    def ready(self, endpoint: str) -> bool:
        ep = self.get(f"{NS_API}/inferenceendpoints/{endpoint}")
        conds = {c["type"]: c["status"] for c in (ep.get("status") or {}).get("conditions") or ()}
        return conds.get("Ready") == "True"

    def metric(self, node: str, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_ports[node]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c["type"] == kind:
            return str(c["status"])
    return None


def _endpoint(world: World, name: str, image: str, replicas: int = 1) -> dict[str, Any]:
    spec = parse_endpoint(
        {"name": name, "model": {"source": world.model}, "image": image,
         "engine": {"simulated": {"profile": "tiny", "time_scale": 0.05}},
         "replicas": {"min": replicas, "max": 4},
         "modelCacheConfig": {
             "image": {"enabled": True},
             "weights": {"enabled": True, "nodes": {"selector": {"pool": "gpu"}},
                         "minReady": 1, "timeoutSeconds": 60}}},
        origin="test",
    )  # fmt: skip
    return endpoint_object(spec, namespace=NS)


def _preheat() -> str:
    return str(Path(sys.executable).parent / "preheat")


@pytest.fixture(scope="module")
def world(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """Registry with the engine image, model origin, this module's share of the session
    cluster (namespace k8s-images, two nodes), agents with mirrors, operator."""
    base = tmp_path_factory.mktemp("k8s-images")
    generate_model(base / "origin" / "m", 200_000, shards=1, seed=5)
    write_http_manifest(base / "origin" / "m")
    layout = write_layout(base / "layout", [MiB, MiB // 2, 1000], seed=21)
    with (
        registry(base / "reg") as reg,
        nginx_origin(base / "origin") as nginx,
        kube_share(kube_session, namespaces=[NS],
                   nodes={n: {"pool": "gpu"} for n in NODES}) as kube,
    ):  # fmt: skip
        reg.push(layout.path, "team/engine:v1")
        world = World(kube, reg, layout, reg.ref("team/engine:v1"),
                      nginx.url("m/preheat-manifest.json"), base)  # fmt: skip
        rbac = [m for m in system_manifests()  # settings Roles too: agents read preheat-settings
                if m["kind"] in {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
                or (m["kind"] in {"Role", "RoleBinding"}
                    and m["metadata"]["namespace"] == "preheat-system")]  # fmt: skip
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        agent_conf = kube.sa_kubeconfig(
            base / "agent.kubeconfig", "preheat-system", "preheat-agent"
        )
        try:
            for node in NODES:
                world.mirror_ports[node], world.metrics_ports[node] = free_port(), free_port()
                world.procs.append(start_process(
                    [_preheat(), "agent", "--node", node, "--store", str(world.store(node)),
                     "--kubeconfig", str(agent_conf), "--metrics-port",
                     str(world.metrics_ports[node]), "--resync", "1", "--backoff", "0.3",
                     "--mirror-port", str(world.mirror_ports[node]),
                     "--mirror-upstream", reg.url],
                    base / f"agent-{node}.log", env=env, inherit_env=False,
                ))  # fmt: skip
            op_conf = kube.sa_kubeconfig(
                base / "operator.kubeconfig", "preheat-system", "preheat-operator"
            )
            world.procs.append(start_process(
                [_preheat(), "operator", "--kubeconfig", str(op_conf), "--namespace", NS,
                 "--metrics-port", str(free_port()), "--tick", "1"],
                base / "operator.log", env=env, inherit_env=False,
            ))  # fmt: skip
            yield world
        finally:
            for p in world.procs:
                p.stop(10)


def test_agents_pre_pull_the_image_once_per_node_and_the_status_shows_it(world: World) -> None:
    """The endpoint's image lands in both target nodes' stores (each layer fetched from
    the registry once per node), is referenced for the endpoint, and shows Ready in both
    NodeCaches and in the ModelImageCache (readyNodes 2, Ready True, the digest)."""
    world.kube.rest().must("POST", f"{NS_API}/inferenceendpoints",
                           _endpoint(world, "chat", world.image))  # fmt: skip
    mic = until("ModelImageCache Ready on both nodes",
                 lambda: (o := world.image_cache()) and _condition(o, "Ready") == "True" and o,
                 timeout=90)  # fmt: skip
    assert mic["status"]["readyNodes"] == 2 and mic["status"]["targetNodes"] == list(NODES)
    assert mic["status"]["digest"] == world.layout.digest
    assert _condition(mic, "Degraded") == "False"
    for node in NODES:
        row = world.image_row(node)
        assert row["state"] == "Ready" and row["digest"] == world.layout.digest
        assert row["readyAt"] and row["references"] == 1
        status = world.get(f"{API}/nodecaches/{node}")["status"]
        assert status["revisionCount"] == 1  # the model; the image is under images
        (held,) = ImageCache(NodeStore(world.store(node))).images()
        assert held.references == (f"{NS}/chat",)
    for digest, _size in world.layout.images["linux/amd64"].layers:
        gets = world.reg.requests(f"GET /v2/team/engine/blobs/{digest}")
        assert len(gets) == 2, gets  # once per node
    until("endpoint chat Ready", lambda: world.ready("chat"), timeout=90)
    out = world.kube.kubectl("get", "modelimagecaches", "-n", NS).stdout
    print(out, world.kube.kubectl("get", "nodecaches", "-o", "wide").stdout)
    assert "READY NODES" in out and "True" in out


def test_skopeo_pulls_through_an_agent_mirror_with_no_upstream_request(world: World) -> None:
    """What the node's container runtime would do: skopeo copies the image from img-a's
    mirror; the registry sees no request and the agent's /metrics counts the hits."""
    before = len(world.reg.requests())
    port = world.mirror_ports["img-a"]
    skopeo("copy", "--src-tls-verify=false", f"docker://127.0.0.1:{port}/team/engine:v1",
           f"oci:{world.base / 'copied'}:v1")  # fmt: skip
    assert world.reg.requests()[before:] == []
    for digest, _ in world.layout.images["linux/amd64"].layers:
        assert (
            world.layout.blob(digest).read_bytes()
            == (world.base / "copied/blobs/sha256" / digest.removeprefix("sha256:")).read_bytes()
        )
    layers = world.layout.images["linux/amd64"].layers
    hits = world.metric("img-a", 'preheat_agent_mirror_requests_total{result="hit"}')
    served = world.metric("img-a", 'preheat_agent_mirror_bytes_total{result="hit"}')
    assert hits >= len(layers) + 2  # manifest, config, layers
    assert served >= sum(s for _, s in layers)
    assert world.metric("img-a", 'preheat_agent_mirror_requests_total{result="miss"}') == 0


def test_a_second_endpoint_shares_the_image_and_its_pod_records_cache(world: World) -> None:
    """A second endpoint on the same image joins the one ModelImageCache (each node now
    references the image twice, nothing is pulled again); its pod, created after the
    nodes hold the image, records `image_source: cache`; revisions carry `readyAt`."""
    before = len(world.reg.requests("/blobs/"))
    world.kube.rest().must("POST", f"{NS_API}/inferenceendpoints",
                           _endpoint(world, "again", world.image))  # fmt: skip
    until("endpoint again Ready", lambda: world.ready("again"), timeout=120)
    assert world.image_cache()["spec"]["endpoints"] == ["again", "chat"]
    until("two references per node",
           lambda: all(world.image_row(n).get("references") == 2 for n in NODES))  # fmt: skip
    assert len(world.reg.requests("/blobs/")) == before
    api = kube_config.new_client_from_config(str(world.kube.kubeconfig))
    try:
        (rec,) = PodStartRecorder(api, NS, endpoint="again").sync()
    finally:
        api.close()
    assert rec.image_source == "cache" and rec.image_ready is not None
    assert rec.weights_source == "cache"
    revs = world.get(f"{API}/nodecaches/{rec.node}")["status"]["revisions"]
    assert revs and all(r.get("readyAt") for r in revs if r["state"] == "Ready")


def test_a_registry_that_is_down_blocks_nothing(world: World) -> None:
    """An endpoint whose image registry is down still becomes Ready; the agents report the
    failed pull (with the reason) and the ModelImageCache says Degraded."""
    dead = f"127.0.0.1:{free_port()}/team/gone:v1"
    world.kube.rest().must("POST", f"{NS_API}/inferenceendpoints", _endpoint(world, "down", dead))
    until("endpoint down Ready", lambda: world.ready("down"), timeout=90)
    row = until("a Failed image row", lambda: (r := world.image_row("img-a", dead))
                 and r["state"] == "Failed" and r)  # fmt: skip
    assert "127.0.0.1" in row["message"]
    mic = until("Degraded", lambda: (o := world.image_cache(dead))
                 and _condition(o, "Degraded") == "True" and o)  # fmt: skip
    assert mic["status"]["readyNodes"] == 0
    world.kube.rest().must("DELETE", f"{NS_API}/inferenceendpoints/down")


def test_deleting_the_endpoints_drops_the_references_and_keeps_the_image(world: World) -> None:
    """Deleting both endpoints removes their ModelImageCache; each agent drops the
    references, and the image stays in the store for the eviction policy."""
    for name in ("chat", "again"):
        world.kube.rest().must("DELETE", f"{NS_API}/inferenceendpoints/{name}")

    def unreferenced() -> bool:
        return all(world.image_row(n).get("references") == 0 for n in NODES)

    try:
        until("references dropped", unreferenced)
    except AssertionError as exc:
        mics = [o["spec"] for o in world.get(f"{NS_API}/modelimagecaches")["items"]]
        raise AssertionError(f"{exc}; ModelImageCaches: {mics}") from None
    assert world.get(f"{NS_API}/modelimagecaches")["items"] == [] or all(
        o["spec"]["image"] != world.image for o in world.get(f"{NS_API}/modelimagecaches")["items"]
    )
    for node in NODES:
        (held,) = [
            i for i in ImageCache(NodeStore(world.store(node))).images()
            if i.top_digest == world.layout.digest
        ]  # fmt: skip
        assert held.references == ()
