"""The node agent (`preheat agent`) on a real v1.20.2 control plane.

Three stand-in nodes, one agent process per node, each with its own store directory and a
ServiceAccount token bound to the rendered agent ClusterRole (so every API call is checked
by RBAC). Models come from a real nginx origin on 127.0.0.1. The agents' effects are
checked through the API (NodeCache status, Node labels) and their stores on disk.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes import config as kube_config

from preheat.bench.models import generate_model, write_http_manifest
from preheat.runtime.kubernetes.nodecache_status import (
    SNAPSHOT_ANNOTATION,
    HeldRevision,
    WantedRevision,
    nodecache_status,
    revision_label,
    revision_labels_patch,
    targets_node,
)
from preheat.runtime.kubernetes.render import system_manifests
from preheat.runtime.kubernetes.revocations import sync_revocation_statuses
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.testing.kube import (
    KubeCluster,
    forbidden_in,
)
from preheat.testing.kubespace import kube_share
from preheat.testing.kubewait import until
from preheat.testing.origins import HttpOrigin, nginx_origin
from preheat.testing.procs import Process, free_port

pytestmark = pytest.mark.kubernetes

NS = "k8s-agent"
NODES = ("agt-a", "agt-b", "agt-c")
NC = "/apis/preheat.dev/v1alpha1/nodecaches"
MDC = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/modeldatacaches"
MODEL_BYTES = 3_000_000


@pytest.fixture(scope="module")
def kube(kube_session: KubeCluster) -> Iterator[KubeCluster]:
    """This module's share of the session cluster: namespace k8s-agent, three stand-in
    nodes and the rendered agent RBAC, its settings Role included (all removed when this
    module ends)."""
    nodes = {name: ({"pool": "gpu"} if name != "agt-c" else {}) for name in NODES}
    with kube_share(kube_session, namespaces=[NS], nodes=nodes) as cluster:
        rbac = [
            m
            for m in system_manifests()
            if m["kind"] in {"Namespace", "ServiceAccount"}
            or (
                m["metadata"]["name"] == "preheat-agent"
                and m["kind"] in {"ClusterRole", "ClusterRoleBinding"}
            )
            # the settings and slot Leases a plain agent reads too (agent_peers.OriginOnly)
            or (
                m["metadata"]["name"] == "preheat-agent-peers"
                and m["kind"] in {"Role", "RoleBinding"}
            )
        ]
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
        yield cluster


@dataclass
class Model:
    origin: HttpOrigin
    root: Path
    url: str
    revision: str
    digest: str
    size: int


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    """A generated 3 MB model behind nginx, with its revision resolved once."""
    root = tmp_path_factory.mktemp("origin")
    generate_model(root / "m", MODEL_BYTES, shards=2, seed=7)
    write_http_manifest(root / "m")
    size = sum(
        p.stat().st_size for p in (root / "m").iterdir() if p.name != "preheat-manifest.json"
    )
    with nginx_origin(root) as origin:
        url = origin.url("m/preheat-manifest.json")
        revision, manifest = NodeStore(tmp_path_factory.mktemp("probe")).resolve(url)
        yield Model(origin, root, url, revision, manifest.digest, size)


class Agent:
    """One `preheat agent` process for a node, stopped by PID."""

    def __init__(self, node: str, store: Path, kubeconfig: Path, log: Path) -> None:
        self.node, self.store, self.kubeconfig, self.log = node, store, kubeconfig, log
        self.port = free_port()
        self.proc: Process | None = None

    def argv(self) -> list[str]:
        exe = Path(sys.executable).parent / "preheat"
        return [
            str(exe), "agent", "--node", self.node, "--store", str(self.store),
            "--kubeconfig", str(self.kubeconfig), "--metrics-port", str(self.port),
            "--resync", "1", "--backoff", "0.3",
        ]  # fmt: skip

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        self.proc = start_process(self.argv(), self.log, env=env, inherit_env=False)
        until(f"agent {self.node} serving", lambda: self.get("/inventory"))

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.stop(0.1, sig=signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(10)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str) -> float:
        """A sample's value from /metrics (0 when absent)."""
        total = 0.0
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def agents(
    kube: KubeCluster, model: Model, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Agent]]:
    """One agent per node, each with its own store, authenticated as the preheat-agent SA."""
    base = tmp_path_factory.mktemp("agents")
    kubeconfig = kube.sa_kubeconfig(base / "agent.kubeconfig", "preheat-system", "preheat-agent")
    out = {n: Agent(n, base / n / "store", kubeconfig, base / f"{n}.log") for n in NODES}
    try:
        for a in out.values():
            a.start()
        _create_cache(kube, "tiny", model.url, model.revision, ["agt-a", "agt-b"])
        yield out
    finally:
        for a in out.values():
            a.stop()


def _create_cache(
    kube: KubeCluster,
    name: str,
    source: str,
    revision: str,
    nodes: list[str],
    *,
    namespace: str = NS,
    **extra: Any,
) -> None:
    body = {
        "apiVersion": "preheat.dev/v1alpha1",
        "kind": "ModelDataCache",
        "metadata": {"name": name},
        "spec": {"source": source, "revision": revision, "nodes": {"names": nodes}, **extra},
    }
    kube.rest().must(
        "POST", f"/apis/preheat.dev/v1alpha1/namespaces/{namespace}/modeldatacaches", body
    )


def _nodecache(kube: KubeCluster, node: str) -> dict[str, Any]:
    return dict(kube.rest().get(f"{NC}/{node}"))


def _ready_revision(kube: KubeCluster, node: str, revision: str) -> dict[str, Any] | None:
    status = _nodecache(kube, node).get("status") or {}
    for r in status.get("revisions") or ():
        if r["revision"] == revision and r["state"] == "Ready":
            return dict(r)
    return None


def test_targeted_nodes_warm_report_ready_and_get_labelled(
    kube: KubeCluster, agents: dict[str, Agent], model: Model
) -> None:
    """The two target nodes' agents fetch the revision, report it Ready with its bytes in
    their NodeCache and label their Node; the third agent fetches nothing."""
    label = revision_label(model.digest)
    for node in ("agt-a", "agt-b"):
        rev = until(f"{node} Ready", lambda n=node: _ready_revision(kube, n, model.revision))
        assert rev["bytes"] == model.size
        nc = _nodecache(kube, node)
        conds = {c["type"]: c for c in nc["status"]["conditions"]}
        assert conds["Ready"]["status"] == "True"
        assert conds["Ready"]["observedGeneration"] == nc["metadata"]["generation"]
        assert nc["status"]["usedBytes"] == model.size
        assert nc["status"]["freeBytes"] > 0
        labels = until(
            f"{node} labelled",
            lambda n=node: (
                label in (kube.rest().get(f"/api/v1/nodes/{n}")["metadata"]["labels"])
                and kube.rest().get(f"/api/v1/nodes/{n}")["metadata"]["labels"]
            ),
        )
        assert labels[label] == "true" and len(label) - len("preheat.dev/") <= 63
        assert agents[node].metric("preheat_agent_bytes_fetched_total") == model.size
        inv = json.loads(agents[node].get("/inventory"))["nodes"][0]
        assert inv["node"] == node and inv["used_bytes"] == model.size
        assert [s["manifest_digest"] for s in inv["snapshots"]] == [model.digest]
        used = agents[node].metric(f'preheat_node_used_bytes{{node="{node}"}}')
        assert used == model.size
    c = until("agt-c NodeCache", lambda: _nodecache(kube, "agt-c").get("status"))
    assert c["revisionCount"] == 0 and not c.get("revisions")
    assert NodeStore(agents["agt-c"].store).snapshots() == []
    assert label not in kube.rest().get("/api/v1/nodes/agt-c")["metadata"].get("labels", {})
    assert agents["agt-c"].metric("preheat_agent_bytes_fetched_total") == 0


def test_pod_with_snapshot_annotation_is_leased_until_deleted(
    kube: KubeCluster, agents: dict[str, Agent], model: Model
) -> None:
    """A pod bound to agt-a naming the snapshot gets a store lease, which the agent drops
    once the pod is deleted; meanwhile eviction never offers the leased snapshot."""
    until("agt-a Ready", lambda: _ready_revision(kube, "agt-a", model.revision))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "user", "annotations": {SNAPSHOT_ANNOTATION: model.digest}},
        "spec": {
            "nodeName": "agt-a",
            "terminationGracePeriodSeconds": 2,
            "containers": [{"name": "c", "image": "x", "command": ["sleep", "300"]}],
        },
    }
    created = kube.rest().must("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    holder = f"pod:{NS}/user:{created['metadata']['uid']}"
    store = NodeStore(agents["agt-a"].store)
    until("lease taken", lambda: store.leases(model.digest) == [holder])
    assert model.digest not in [c.digest for c in store.eviction_candidates()]
    leased = until(
        "lease in status",
        lambda: (_ready_revision(kube, "agt-a", model.revision) or {}).get("leases") == 1,
    )
    assert leased
    kube.rest().must("DELETE", f"/api/v1/namespaces/{NS}/pods/user")
    until("lease released", lambda: store.leases(model.digest) == [], timeout=40)
    assert model.digest in [c.digest for c in store.eviction_candidates()]


def test_restarted_agent_fetches_nothing_and_writes_no_status(
    kube: KubeCluster, agents: dict[str, Agent], model: Model
) -> None:
    """A settled agent writes no status; SIGKILLed and restarted on its store it re-lists,
    fetches 0 bytes, keeps Ready and leaves the unchanged NodeCache alone (same
    resourceVersion)."""
    agent = agents["agt-b"]
    until("agt-b Ready", lambda: _ready_revision(kube, "agt-b", model.revision))
    # Settled: a write already under way when Ready showed lands within two passes
    # (under load one more write was seen there); count from after them.
    settle = agent.metric("preheat_agent_reconciles_total")
    until("agt-b settles", lambda: agent.metric("preheat_agent_reconciles_total") >= settle + 2)
    # In steady state three more reconcile passes write no status (no churn).
    writes, passes = (
        agent.metric(f"preheat_agent_{m}_total") for m in ("status_writes", "reconciles")
    )
    until("agt-b reconciles", lambda: agent.metric("preheat_agent_reconciles_total") >= passes + 3)
    assert agent.metric("preheat_agent_status_writes_total") == writes
    blobs = {p: p.stat().st_mtime_ns for p in (agent.store / "blobs").rglob("*") if p.is_file()}
    agent.kill()
    before = _nodecache(kube, "agt-b")
    agent.start()
    until("restarted agent reconciled", lambda: agent.metric("preheat_agent_reconciles_total") >= 3)
    assert agent.metric("preheat_agent_bytes_fetched_total") == 0
    assert agent.metric("preheat_agent_warmups_total") == 0
    assert agent.metric("preheat_agent_status_writes_total") == 0
    after = _nodecache(kube, "agt-b")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert _ready_revision(kube, "agt-b", model.revision)
    assert {p: p.stat().st_mtime_ns for p in blobs} == blobs


def test_failed_origin_with_credentials_is_redacted_then_retried(
    kube: KubeCluster, agents: dict[str, Agent], model: Model
) -> None:
    """An origin that is down, named with user:pw@, leaves a lastFailure on agt-c's
    NodeCache without the password; once the origin comes up the retry warms it."""
    port = free_port()
    url = f"http://user:pw@127.0.0.1:{port}/m/preheat-manifest.json"
    _create_cache(kube, "guarded", url, model.revision, ["agt-c"])
    status = until(
        "failure reported",
        lambda: (s := _nodecache(kube, "agt-c").get("status") or {}).get("lastFailure") and s,
    )
    text = json.dumps(status)
    assert ":pw@" not in text and "pw" not in text.replace("preheat", "")
    assert str(port) in status["lastFailure"]["message"]
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds["Degraded"] == "True" and conds["Ready"] == "False"
    assert any(r["state"] == "Failed" for r in status["revisions"])
    assert "pw" not in agents["agt-c"].get("/inventory").replace("preheat", "")
    assert ":pw@" not in agents["agt-c"].get("/metrics")
    assert ":pw@" not in agents["agt-c"].log.read_text()  # the agent's own log lines
    with nginx_origin(model.root, port=port):
        until("retried after the origin came up",
               lambda: _ready_revision(kube, "agt-c", model.revision), timeout=45)  # fmt: skip
    assert agents["agt-c"].metric("preheat_agent_bytes_fetched_total") == model.size


def test_agents_stay_within_the_rendered_role(agents: dict[str, Agent]) -> None:
    """Every agent ran as the preheat-agent ServiceAccount and no API call failed (no 403)."""
    for a in agents.values():
        assert a.metric("preheat_agent_reconciles_total") >= 1
        errors = [x for x in a.get("/metrics").splitlines() if x.startswith("preheat_agent_api_e")]
        assert a.metric("preheat_agent_api_errors_total") == 0, errors
        assert not forbidden_in(a.log.read_text())


def test_a_cluster_revocation_reaches_the_agents_and_lifts(
    kube: KubeCluster, agents: dict[str, Agent], model: Model, tmp_path: Path
) -> None:
    """A Revocation (by manifest digest) removes the revision from agt-b's store and
    refuses its warm-up there; every agent lists the key in its NodeCache and the
    Revocation's status says it is applied on all nodes; deleting it lets agt-b warm the
    revision again."""
    generate_model(model.root / "rv", 400_000, shards=1, seed=5)
    write_http_manifest(model.root / "rv")
    url = model.origin.url("rv/preheat-manifest.json")
    revision, manifest = NodeStore(tmp_path / "probe").resolve(url)
    _create_cache(kube, "rvk", url, revision, ["agt-b"])
    until("agt-b Ready", lambda: _ready_revision(kube, "agt-b", revision))
    key = f"sha256:{manifest.digest}"
    rvk = "/apis/preheat.dev/v1alpha1/revocations"
    kube.rest().must("POST", rvk, {
        "apiVersion": "preheat.dev/v1alpha1", "kind": "Revocation",
        "metadata": {"name": "cve-1"}, "spec": {"key": key, "reason": "CVE-2026-0001"},
    })  # fmt: skip
    store = NodeStore(agents["agt-b"].store)
    until("removed from agt-b", lambda: not store.has(revision))

    def listed(node: str) -> bool:
        status = _nodecache(kube, node).get("status") or {}
        return any(r["key"] == key for r in status.get("revocations") or ())

    for node in NODES:
        until(f"{node} lists the key", lambda n=node: listed(n))
    assert store.revoked()[key][0] == "CVE-2026-0001"
    failure = until(
        "warm-up refused", lambda: _nodecache(kube, "agt-b")["status"].get("lastFailure")
    )
    assert "revoked" in failure["message"], failure
    assert _ready_revision(kube, "agt-b", revision) is None
    api = kube_config.new_client_from_config(str(kube.kubeconfig))
    try:
        assert sync_revocation_statuses(client.CustomObjectsApi(api), "2026-12-01T00:00:00Z") == 1
    finally:
        api.close()
    st = kube.rest().get(f"{rvk}/cve-1")["status"]
    assert st["appliedNodes"] == sorted(NODES)
    assert [(c["type"], c["status"]) for c in st["conditions"]] == [("Ready", "True")]
    kube.rest().must("DELETE", f"{rvk}/cve-1")
    until("agt-b warms again", lambda: _ready_revision(kube, "agt-b", revision), 30)
    assert key not in store.revoked()
    kube.rest().must("DELETE", f"{MDC}/rvk")


def test_label_goes_when_the_revision_leaves_the_store(
    kube: KubeCluster, agents: dict[str, Agent], model: Model
) -> None:
    """Once no cache wants the revision and it is removed from agt-a's store, the agent
    drops the Node label and reports no revisions (and does not fetch it again)."""
    label = revision_label(model.digest)
    until("agt-a Ready", lambda: _ready_revision(kube, "agt-a", model.revision))
    kube.rest().must("DELETE", f"{MDC}/tiny")
    store = NodeStore(agents["agt-a"].store)
    until("lease-free", lambda: store.leases(model.digest) == [])
    store.delete(model.digest)

    def unlabelled() -> bool:
        labels = kube.rest().get("/api/v1/nodes/agt-a")["metadata"].get("labels") or {}
        status = _nodecache(kube, "agt-a").get("status") or {}
        return label not in labels and status.get("revisionCount") == 0

    until("label removed", unlabelled)
    assert label in kube.rest().get("/api/v1/nodes/agt-b")["metadata"]["labels"]
    assert agents["agt-a"].metric("preheat_agent_bytes_fetched_total") == model.size
    assert NodeStore(agents["agt-a"].store).snapshots() == []


def test_cache_targets_by_names_or_selector_or_all() -> None:
    """spec.nodes.names lists nodes, spec.nodes.selector matches labels, neither means all."""
    names = {"nodes": {"names": ["agt-a"]}}
    selector = {"nodes": {"selector": {"pool": "gpu"}}}
    assert targets_node(names, "agt-a", {}) and not targets_node(names, "agt-b", {})
    assert targets_node(selector, "agt-b", {"pool": "gpu"})
    assert not targets_node(selector, "agt-c", {"pool": "cpu"})
    assert targets_node({}, "agt-c", {}) and targets_node({"nodes": {}}, "agt-c", {})


def test_revision_label_fits_and_patch_adds_and_removes() -> None:
    """The label key is preheat.dev/rev-<12 hex>; the patch adds held ones and nulls the rest."""
    d1, d2 = "ab" * 32, "cd" * 32
    assert revision_label(f"sha256:{d1}") == revision_label(d1) == "preheat.dev/rev-" + d1[:12]
    with pytest.raises(ValueError, match="not a sha256 hex digest"):
        revision_label("latest")
    current = {revision_label(d2): "true", "pool": "gpu"}
    patch = revision_labels_patch(current, [d1])
    assert patch == {revision_label(d1): "true", revision_label(d2): None}
    assert revision_labels_patch({revision_label(d1): "true"}, [d1]) == {}


def test_status_conditions_keep_transition_times_and_redact() -> None:
    """Ready/Progressing/Degraded follow held, filling and failed revisions; a condition
    whose status holds keeps its lastTransitionTime; credentials never reach the status."""
    fail = {"time": "t", "reason": "WarmupFailed", "message": "http://u:pw@h/x: refused"}
    first = nodecache_status(
        generation=3, now="t1", capacity_bytes=None, free_bytes=10, held=[],
        pending=[WantedRevision("r1", "http://u:pw@h/x", "Failed")], wanted=["r1"],
        eviction_order=[], last_failure=fail,
    )  # fmt: skip
    conds = {c["type"]: c for c in first["conditions"]}
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "WarmupFailed"
    assert conds["Degraded"]["status"] == "True" and conds["Ready"]["observedGeneration"] == 3
    assert "pw" not in json.dumps(first)
    held = HeldRevision("ab" * 32, "r1", "http://h/x", 5, False, 0, None)
    second = nodecache_status(
        generation=3, now="t2", capacity_bytes=None, free_bytes=10, held=[held], pending=[],
        wanted=["r1"], eviction_order=["ab" * 32], last_failure=None, previous=first,
    )  # fmt: skip
    conds2 = {c["type"]: c for c in second["conditions"]}
    assert conds2["Ready"]["status"] == "True" and conds2["Ready"]["lastTransitionTime"] == "t2"
    assert conds2["Progressing"]["lastTransitionTime"] == "t1"  # False both times
    assert second["revisions"][0]["state"] == "Ready" and second["usedBytes"] == 5


def test_slow_fill_reports_filling_while_the_loop_keeps_reconciling(
    kube: KubeCluster, agents: dict[str, Agent], tmp_path: Path
) -> None:
    """While a rate-limited fill runs, agt-c's NodeCache shows it Filling with Progressing
    True, and the agent keeps reconciling and serving (the fill does not block the loop);
    once held, the cache's pin and priority are applied to the store."""
    generate_model(tmp_path / "slow", MODEL_BYTES, shards=2, seed=11)
    write_http_manifest(tmp_path / "slow")
    agent = agents["agt-c"]
    with nginx_origin(tmp_path, limit_rate=200_000) as origin:
        url = origin.url("slow/preheat-manifest.json")
        revision, manifest = NodeStore(tmp_path / "probe").resolve(url)
        _create_cache(kube, "slow", url, revision, ["agt-c"], pin=True, priority=3)

        def filling() -> dict[str, Any] | None:
            status = _nodecache(kube, "agt-c").get("status") or {}
            revs = [r for r in status.get("revisions") or () if r["revision"] == revision]
            return status if revs and revs[0]["state"] == "Filling" else None

        status = until("Filling reported", filling)
        conds = {c["type"]: c["status"] for c in status["conditions"]}
        assert conds["Progressing"] == "True" and conds["Ready"] == "False"
        start = agent.metric("preheat_agent_reconciles_total")
        until("loop runs during the fill",
               lambda: agent.metric("preheat_agent_reconciles_total") >= start + 2)  # fmt: skip
        assert not NodeStore(agent.store).has(revision)  # still filling meanwhile
        until("slow revision Ready", lambda: _ready_revision(kube, "agt-c", revision), 60)
    status = _nodecache(kube, "agt-c")["status"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Progressing"] == "False"
    assert NodeStore(agent.store).has(manifest.digest)
    # The cache's pin and priority reach the store; a pinned snapshot is never a candidate.
    info = until(
        "pinned",
        lambda: [
            i
            for i in NodeStore(agent.store).snapshots()
            if i.digest == manifest.digest and i.pinned
        ],
    )[0]
    assert info.priority == 3

    def pinned_in_status() -> dict[str, Any] | None:
        st: dict[str, Any] = _nodecache(kube, "agt-c")["status"]
        mine = [r for r in st["revisions"] if r["revision"] == revision]
        ok = manifest.digest not in st["evictionOrder"] and mine and mine[0].get("pinned")
        return st if ok else None

    status = until("pin in status", pinned_in_status)
    assert status["evictionOrder"]  # the unpinned revision from the guarded cache is one
