"""Start records from engine pods, the dashboard's metrics and least-privilege RBAC on a
real v1.20.2 control plane (one cluster for all three: a cluster boot is most of the cost).

Two stand-in nodes, a real `preheat agent` per node (store under the node's
`/var/lib/preheat/store`, the hostPath the pods mount), a generated 3 MB model behind
nginx, and a `ModelDataCache` that targets tel-a only: tel-a is warm, tel-b cold. The
engine pods carry the operator's contract (labels, `preheat.dev/snapshot` and
`preheat.dev/revision` annotations) and an init container that links the node store's
snapshot when it is there and otherwise pulls from the origin itself (`preheat cache pull`
into an emptyDir). Every component runs with exactly its rendered RBAC: the agents as
`preheat-agent`, the pod start recorder as `preheat-operator`, the router
(`preheat router serve --kubernetes`) as `preheat-router-chat`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from preheat.bench.models import generate_model, write_http_manifest
from preheat.cli import main as cli
from preheat.runtime.kubernetes.api_client import connect
from preheat.runtime.kubernetes.discovery_slices import variant_service_name
from preheat.runtime.kubernetes.podrecords import PodStartRecorder
from preheat.runtime.kubernetes.podrecords_core import ENGINE_LABELS
from preheat.runtime.kubernetes.render import (
    AGENT_PEER_RULES,
    AGENT_RULES,
    OPERATOR_RULES,
    ROUTER_RULES,
    endpoint_manifests,
    system_manifests,
)
from preheat.runtime.kubernetes.render_adapter import ADAPTER_RULES
from preheat.runtime.kubernetes.resources import load_endpoint_file
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.telemetry.events import read_start_records
from preheat.telemetry.records import EventClass, StartRecord
from preheat.testing.kube import KubeCluster, forbidden_in
from preheat.testing.kubespace import kube_share
from preheat.testing.origins import nginx_origin
from preheat.testing.procs import Process, free_port

pytestmark = pytest.mark.kubernetes

NS = "k8s-telemetry"
NODES = {"tel-a": {"pool": "gpu"}, "tel-b": {}}
STORE = "/var/lib/preheat/store"
NC = "/apis/preheat.dev/v1alpha1/nodecaches"
MDC = f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/modeldatacaches"
MODEL_BYTES = 3_000_000
PREHEAT = str(Path(sys.executable).parent / "preheat")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "endpoint.yaml"  # "chat"
ADMIN_TOKEN = "telemetry-admin-token-for-tests"
#: The Service the router discovers variant `main` of `chat` through (the operator's job).
SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": variant_service_name("chat", "main"), "namespace": NS},
    "spec": {
        "selector": {**ENGINE_LABELS, "preheat.dev/endpoint": "chat"},
        "ports": [{"name": "http", "port": 8000}],
    },
}


@dataclass
class Model:
    url: str
    revision: str
    digest: str
    size: int


@dataclass
class Env:
    kube: KubeCluster
    model: Model
    agents: dict[str, Agent]
    operator_kubeconfig: Path
    router_kubeconfig: Path
    agent_kubeconfig: Path
    tmp: Path


class Agent:
    """One `preheat agent` process, stopped by PID."""

    def __init__(self, node: str, store: Path, kubeconfig: Path, log: Path) -> None:
        self.node, self.store, self.log = node, store, log
        self.port = free_port()
        argv = [
            PREHEAT, "agent", "--node", node, "--store", str(store), "--kubeconfig",
            str(kubeconfig), "--metrics-port", str(self.port), "--resync", "1",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        self.proc: Process = start_process(argv, log, env=env, inherit_env=False)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return str(r.read().decode())


@pytest.fixture(scope="module")
def env(kube_session: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """This module's share of the session cluster (namespace k8s-telemetry, two nodes), the
    rendered operator and agent RBAC, the model, an agent per node, and tel-a warmed
    through a ModelDataCache (tel-b is never targeted)."""
    tmp = tmp_path_factory.mktemp("telemetry")
    root = tmp / "origin"
    generate_model(root / "m", MODEL_BYTES, shards=2, seed=11)
    write_http_manifest(root / "m")
    size = sum(
        p.stat().st_size for p in (root / "m").iterdir() if p.name != "preheat-manifest.json"
    )
    with (
        nginx_origin(root) as origin,
        kube_share(kube_session, namespaces=[NS], nodes=NODES) as kube,
    ):
        url = origin.url("m/preheat-manifest.json")
        revision, manifest = NodeStore(tmp / "probe").resolve(url)
        model = Model(url, revision, manifest.digest, size)
        spec, pod = load_endpoint_file(EXAMPLE)
        kinds = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                 "RoleBinding", "InferenceEndpoint"}  # fmt: skip
        rendered = system_manifests() + endpoint_manifests(spec, namespace=NS, pod=pod)
        objs = [o for o in rendered if o["kind"] in kinds] + [SERVICE]
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
        agent_conf = kube.sa_kubeconfig(tmp / "agent.kubeconfig", "preheat-system", "preheat-agent")
        agents = {
            n: Agent(n, kube.root / "nodes" / n / STORE.lstrip("/"), agent_conf, tmp / f"{n}.log")
            for n in NODES
        }
        try:
            body = {
                "apiVersion": "preheat.dev/v1alpha1",
                "kind": "ModelDataCache",
                "metadata": {"name": "chat-rev1"},
                "spec": {"source": url, "revision": revision, "nodes": {"names": ["tel-a"]}},
            }
            kube.rest().must("POST", MDC, body)

            def warm() -> bool:
                status, obj = kube.rest().call("GET", f"{NC}/tel-a")
                revs = (obj or {}).get("status", {}).get("revisions") or () if status == 200 else ()
                return any(r.get("state") == "Ready" for r in revs)

            kube.wait_for("tel-a holds the revision", warm, timeout=60)
            op_conf = kube.sa_kubeconfig(
                tmp / "operator.kubeconfig", "preheat-system", "preheat-operator"
            )
            router_conf = kube.sa_kubeconfig(tmp / "router.kubeconfig", NS, "preheat-router-chat")
            yield Env(kube, model, agents, op_conf, router_conf, agent_conf, tmp)
        finally:
            stops = [threading.Thread(target=a.proc.stop, args=(10,)) for a in agents.values()]
            for t in stops:  # in parallel: each may take seconds to exit under load
                t.start()
            for t in stops:
                t.join()


def engine_pod(name: str, node: str, model: Model) -> dict[str, Any]:
    """An engine pod as the operator makes it (labels, annotations, a weights init step),
    placed on ``node`` by the real scheduler through a nodeSelector."""
    script = (
        'if [ -d "/mnt/store/snapshots/$DIGEST" ]; then '
        'ln -sfn "/mnt/store/snapshots/$DIGEST" /mnt/weights/model; '
        'else preheat cache pull "$ORIGIN" --store /mnt/weights/store | tail -n 1 > /mnt/weights/path '
        '&& ln -sfn "$(cat /mnt/weights/path)" /mnt/weights/model; fi'
    )
    mounts = [
        {"name": "store", "mountPath": "/mnt/store", "readOnly": True},
        {"name": "weights", "mountPath": "/mnt/weights"},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                **ENGINE_LABELS,
                "preheat.dev/endpoint": "chat",
                "preheat.dev/variant": "main",
            },
            "annotations": {
                "preheat.dev/snapshot": model.digest,
                "preheat.dev/revision": model.revision,
            },
        },
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "initContainers": [
                {
                    "name": "weights",
                    "image": "preheat:0.1.0",
                    "command": ["sh", "-c", script],
                    "env": [
                        {"name": "DIGEST", "value": model.digest},
                        {"name": "ORIGIN", "value": model.url},
                    ],
                    "volumeMounts": mounts,
                }
            ],
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
                        "chat",
                        "--snapshot",
                        "/mnt/weights/model",
                    ],
                    "env": [
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                    ],
                    "ports": [{"name": "http", "containerPort": 8000}],
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": "http"},
                        "periodSeconds": 1,
                    },
                    "volumeMounts": mounts,
                }
            ],
            "volumes": [
                {"name": "store", "hostPath": {"path": STORE, "type": "DirectoryOrCreate"}},
                {"name": "weights", "emptyDir": {}},
            ],
            "terminationGracePeriodSeconds": 3,
        },
    }


@dataclass
class Started:
    recorder: PodStartRecorder
    pods: dict[str, dict[str, Any]]


def _pod(kube: KubeCluster, name: str) -> dict[str, Any]:
    return dict(kube.rest().get(f"/api/v1/namespaces/{NS}/pods/{name}"))


def _records(rec: PodStartRecorder, n: int, kube: KubeCluster) -> list[StartRecord]:
    got: list[StartRecord] = kube.wait_for(
        f"{n} start records", lambda: (lambda r: r if len(r) >= n else None)(rec.snapshot()),
        timeout=60,
    )  # fmt: skip
    return got


@pytest.fixture(scope="module")
def started(env: Env) -> Iterator[Started]:
    """The recorder watching (as preheat-operator, probing engines), then a pod on the warm
    node and one on the cold node, both Ready."""
    api, _ = connect(env.operator_kubeconfig)
    recorder = PodStartRecorder(api, NS, endpoint="chat", probe_engines=True, resync_s=2)
    recorder.start()
    try:
        pods = {"warm": engine_pod("chat-warm", "tel-a", env.model),
                "cold": engine_pod("chat-cold", "tel-b", env.model)}  # fmt: skip
        env.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(list(pods.values())))
        _records(recorder, 2, env.kube)
        yield Started(recorder, {k: _pod(env.kube, p["metadata"]["name"]) for k, p in pods.items()})
    finally:
        recorder.stop()
        env.kube.kubectl(
            "delete", "-n", NS, "pod", "chat-warm", "chat-cold", "--wait=false", check=False
        )


def _by_pod(records: list[StartRecord]) -> dict[tuple[str, int], StartRecord]:
    return {(r.replica, r.restart_count): r for r in records}


def test_warm_and_cold_node_pods_give_records_with_their_sources_and_classes(
    env: Env, started: Started
) -> None:
    """The warm-node pod reads the agent's snapshot (cache, cold_pod_warm_node, the store's
    bytes); the cold-node pod pulled from the origin (origin, new_node, the bytes its engine
    read); the engines' own /startup shows where the weights really were."""
    recs = _by_pod(started.recorder.snapshot())
    warm, cold = recs[("chat-warm", 0)], recs[("chat-cold", 0)]
    assert (warm.node, warm.weights_source, warm.event_class) == (
        "tel-a", "cache", EventClass.COLD_POD_WARM_NODE,
    )  # fmt: skip
    assert dict(warm.bytes_from) == {"cache": env.model.size}
    assert (cold.node, cold.weights_source, cold.event_class) == (
        "tel-b", "origin", EventClass.NEW_NODE,
    )  # fmt: skip
    assert dict(cold.bytes_from) == {"origin": env.model.size}
    for r in (warm, cold):
        assert r.ok and r.endpoint == "chat" and r.variant == "main"
        assert r.revision == env.model.revision
        assert r.weights_loaded is not None and r.runtime_started is not None
        assert r.scheduled <= r.weights_ready <= r.runtime_started <= r.healthy  # type: ignore[operator]
    for key, store_side in (("warm", True), ("cold", False)):
        ip = started.pods[key]["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:8000/startup", timeout=5) as resp:
            snap = os.path.realpath(json.loads(resp.read())["snapshot"])
        in_store = snap.startswith(
            os.path.realpath(env.agents[started.pods[key]["spec"]["nodeName"]].store)
        )
        assert in_store is store_side, snap
    # The cold node's agent was never asked for the model: its store is still empty.
    assert json.loads(env.agents["tel-b"].get("/inventory"))["nodes"][0]["snapshots"] == []
    assert started.recorder.api_errors == 0


def test_cli_records_feed_preheat_report_and_count_a_restart(env: Env, started: Started) -> None:
    """`preheat k8s records --out F` appends the two starts, a killed engine container adds
    one warm_restart record (and only it: the file's starts are not appended twice), the
    table names the pods, and `preheat report` reads the file per class."""
    out = env.tmp / "starts.jsonl"
    args = ["k8s", "records", "--kubeconfig", str(env.operator_kubeconfig),
            "--namespace", NS, "--endpoint", "chat"]  # fmt: skip
    runner = CliRunner()

    def run(*extra: str) -> str:
        res = runner.invoke(cli, [*args, *extra], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return res.output

    assert "2 start records, 2 new" in run("--out", str(out))
    pid = int(started.pods["warm"]["status"]["containerStatuses"][0]["containerID"].split("//")[1])
    os.killpg(pid, signal.SIGKILL)
    restart = env.kube.wait_for(
        "a warm_restart record",
        lambda: _by_pod(started.recorder.snapshot()).get(("chat-warm", 1)),
        timeout=60,
    )
    assert restart.event_class is EventClass.WARM_RESTART and restart.ok
    assert restart.node == "tel-a" and restart.weights_source == "cache"
    # One pass now sees the cold pod's start and the warm pod's restart: one is new.
    assert "2 start records, 1 new" in run("--out", str(out))
    recs = read_start_records(out)
    assert sorted((r.replica, r.restart_count, r.event_class.value) for r in recs) == [
        ("chat-cold", 0, "new_node"),
        ("chat-warm", 0, "cold_pod_warm_node"),
        ("chat-warm", 1, "warm_restart"),
    ]
    table = run()
    assert "chat-cold" in table and "origin" in table and "warm_restart" in table
    report = runner.invoke(
        cli, ["report", "--events", str(out), "--out", str(env.tmp / "report"), "--json"]
    )
    assert report.exit_code == 0, report.output
    for cls in ("new_node", "cold_pod_warm_node", "warm_restart"):
        assert cls in report.output


def test_recorder_registry_exports_local_mode_start_metrics(started: Started) -> None:
    """The recorder's registry has local mode's series: starts per class and outcome,
    cache hits and misses, bytes by source, readiness histograms per class."""
    text = generate_latest(started.recorder.registry).decode()
    assert 'preheat_starts_total{event_class="cold_pod_warm_node",outcome="ok"} 1.0' in text
    assert 'preheat_starts_total{event_class="new_node",outcome="ok"} 1.0' in text
    assert 'preheat_weights_cache_total{event_class="new_node",result="miss"} 1.0' in text
    assert 'preheat_weights_bytes_total{source="origin"}' in text
    assert 'preheat_start_ready_seconds_bucket{event_class="cold_pod_warm_node"' in text
    assert 'preheat_start_stage_seconds_count{event_class="new_node",stage="weights_ready"}' in text


# --- the Grafana dashboard queries only what is exported ----------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "preheat-dashboard.json"
_METRIC = re.compile(r"\b(preheat_[a-z0-9_]+|vllm:[a-z0-9_]+)")


def _queried() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    return {m for e in exprs for m in _METRIC.findall(e)}


def _exported(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can have (a declared family counts even with
    no sample yet: a labelled counter has none until its first increment)."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(text):
        out.add(fam.name)
        out |= {s.name for s in fam.samples}
        if fam.type == "counter":
            out.add(fam.name + "_total")
        elif fam.type == "histogram":
            out |= {fam.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return out


def _get(url: str, body: Any = None, *, token: str | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=15) as r:
        return str(r.read().decode())


@dataclass
class Router:
    metrics: str
    config: dict[str, Any]
    log: str


@pytest.fixture(scope="module")
def router(env: Env, started: Started) -> Iterator[Router]:
    """`preheat router serve --kubernetes --endpoint chat` as the preheat-router-chat
    ServiceAccount (the rendered Role), once it routes to both engine pods, after a few
    completions through it."""
    port = free_port()
    argv = [PREHEAT, "router", "serve", "--kubernetes", "--endpoint", "chat", "--namespace",
            NS, "--kubeconfig", str(env.router_kubeconfig), "--port", str(port)]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    environ |= {"PREHEAT_ADMIN_TOKEN": ADMIN_TOKEN, "PREHEAT_ROUTER_SALT": "a-salt-of-16-bytes+"}
    log = env.tmp / "router.log"
    proc = start_process(argv, log, env=environ, inherit_env=False)
    base = f"http://127.0.0.1:{port}"

    def both() -> dict[str, Any] | None:
        assert proc.running, log.read_text()
        try:
            config: dict[str, Any] = json.loads(_get(base + "/admin/config", token=ADMIN_TOKEN))
        except OSError:
            return None
        (main,) = config["variants"]
        ready = [i for i in main["instances"] if i["state"] == "healthy"]
        return config if len(ready) == 2 else None

    try:
        config = env.kube.wait_for("the router routes to both pods", both, timeout=60)
        for i in range(6):
            prompt = "shared system prompt " * 20 + str(i)
            body = {"model": "chat", "prompt": prompt, "max_tokens": 2}
            json.loads(_get(base + "/v1/completions", body))
        yield Router(_get(base + "/metrics"), config, log.read_text())
    finally:
        proc.stop(10)


@pytest.fixture
def recorder_http(env: Env, started: Started) -> Iterator[str]:
    """`preheat k8s records --watch --metrics-port` (as preheat-operator): its /metrics once
    it has recorded the pods' starts."""
    port = free_port()
    argv = [PREHEAT, "k8s", "records", "--kubeconfig", str(env.operator_kubeconfig),
            "--namespace", NS, "--watch", "120", "--metrics-port", str(port)]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    proc = start_process(argv, env.tmp / "records-watch.log", env=environ, inherit_env=False)
    url = f"http://127.0.0.1:{port}/metrics"

    def scraped() -> str | None:
        assert proc.running, (env.tmp / "records-watch.log").read_text()
        try:
            text = _get(url)
        except OSError:
            return None
        return text if 'preheat_starts_total{event_class="new_node"' in text else None

    try:
        yield env.kube.wait_for("the recorder's /metrics", scraped, timeout=60)
    finally:
        proc.stop(5)


def test_every_metric_the_dashboard_queries_is_exported(
    env: Env, router: Router, recorder_http: str
) -> None:
    """The dashboard's PromQL names only series that the real /metrics of an agent, a
    router, an engine pod and `preheat k8s records --watch --metrics-port` export (so it
    cannot drift), and each of those four sources feeds at least one panel."""
    queried = _queried()
    engine_ip = _pod(env.kube, "chat-warm")["status"]["podIP"]
    sources = {
        "agent": env.agents["tel-a"].get("/metrics"),
        "router": router.metrics,
        "engine": _get(f"http://{engine_ip}:8000/metrics"),
        "recorder": recorder_http,
    }
    exported = {name: _exported(text) for name, text in sources.items()}
    missing = sorted(queried - set().union(*exported.values()))
    assert not missing, f"the dashboard queries series nothing exports: {missing}"
    for name, names in exported.items():
        assert queried & names, f"no panel reads the {name}'s metrics"
    assert "preheat_router_requests_total{" in router.metrics  # the completions counted


def test_dashboard_is_importable_grafana_json() -> None:
    """One Prometheus data-source input that every panel and target uses, unique panel
    ids, a title and description on every panel, the event classes' readiness panel."""
    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["title"] and p["description"] and p["targets"], p
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"])
    titles = " ".join(p["title"] for p in panels)
    for word in ("per event class", "hit ratio", "by source", "KV", "share", "warm-ups", "Failed"):
        assert word in titles, word


# --- RBAC: each component with exactly its rendered rules, as a real process ---------------
#
# Already shown elsewhere: every rendered manifest passes `kubectl apply --dry-run=server`
# and single REST calls as the agent's and router's tokens are allowed or refused
# (test_k8s_cluster). Here: what the authorizer grants each ServiceAccount is exactly the
# rendered rules; the agents, the router and the recorder above ran as those accounts and
# never got a 403; with the very kubeconfig each used, a verb outside its rules is refused.

AGENT_SA = "system:serviceaccount:preheat-system:preheat-agent"
OPERATOR_SA = "system:serviceaccount:preheat-system:preheat-operator"
ROUTER_SA = f"system:serviceaccount:{NS}:preheat-router-chat"
ADAPTER_SA = "system:serviceaccount:preheat-system:preheat-metrics-adapter"
#: What every authenticated identity may do (system:basic-user): not preheat's to render.
_BASELINE = {
    ("selfsubjectaccessreviews.authorization.k8s.io", "create"),
    ("selfsubjectrulesreviews.authorization.k8s.io", "create"),
}


def _granted(kube: KubeCluster, who: str, namespace: str) -> set[tuple[str, str]]:
    """(resource[.group][/subresource], verb) pairs the authorizer grants ``who``."""
    out = kube.kubectl("auth", "can-i", "--list", f"--as={who}", "-n", namespace).stdout
    granted: set[tuple[str, str]] = set()
    for line in out.splitlines()[1:]:
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) < 4 or cols[1] != "[]":  # non-resource URLs (/healthz, /api, ...)
            continue
        granted |= {(cols[0], v) for v in cols[3].strip("[]").split()}
    return granted - _BASELINE


def _rendered(rules: Sequence[Mapping[str, list[str]]]) -> set[tuple[str, str]]:
    """The same pairs from rendered rules (kubectl writes `plural.group/subresource`)."""
    out = set()
    for r in rules:
        for group in r["apiGroups"]:
            for res in r["resources"]:
                base, _, sub = res.partition("/")
                name = (f"{base}.{group}" if group else base) + (f"/{sub}" if sub else "")
                out |= {(name, verb) for verb in r["verbs"]}
    return out


@pytest.mark.parametrize(
    ("who", "rules"),
    [
        (AGENT_SA, AGENT_RULES),
        (OPERATOR_SA, OPERATOR_RULES),
        (ROUTER_SA, ROUTER_RULES),
        (ADAPTER_SA, ADAPTER_RULES),
    ],
    ids=["agent", "operator", "router", "metrics-adapter"],
)
def test_the_authorizer_grants_exactly_the_rendered_rules(
    env: Env, who: str, rules: Sequence[Mapping[str, list[str]]]
) -> None:
    """`kubectl auth can-i --list --as=<ServiceAccount>` in the endpoints' namespace lists
    every rendered verb and nothing more (beyond self access reviews); in kube-system the
    namespaced router Role grants nothing, and the metrics adapter gets only the front-proxy
    CA's ConfigMap (the built-in extension-apiserver-authentication-reader Role)."""
    granted = _granted(env.kube, who, NS)
    want = _rendered(rules)
    assert granted == want, f"missing {sorted(want - granted)}, extra {sorted(granted - want)}"
    if who == ROUTER_SA:
        assert _granted(env.kube, who, "kube-system") == set()
    if who == AGENT_SA:  # its own namespace adds the origin slot Leases and settings (peers)
        own = _granted(env.kube, who, "preheat-system")
        want = _rendered([*rules, *AGENT_PEER_RULES])
        assert own == want, f"missing {sorted(want - own)}, extra {sorted(own - want)}"

    if who == ADAPTER_SA:
        extra = _granted(env.kube, who, "kube-system") - want
        assert extra == {("configmaps", v) for v in ("get", "list", "watch")}, extra


def _kubectl_as(env: Env, conf: Path, *args: str) -> tuple[int, str]:
    """The matched kubectl with a component's own kubeconfig (not the admin's)."""
    proc = subprocess.run(
        [str(env.kube.bin_dir / "kubectl"), f"--kubeconfig={conf}", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return proc.returncode, proc.stderr + proc.stdout


def _refused(env: Env, conf: Path, account: str, *attempts: tuple[str, ...]) -> None:
    for args in attempts:
        code, out = _kubectl_as(env, conf, *args)
        assert code != 0 and "Forbidden" in out and account in out, (args, out)


def test_agents_did_their_job_without_a_403_and_are_refused_outside_their_role(
    env: Env, started: Started
) -> None:
    """Both agents (preheat-agent's token) warmed, wrote NodeCaches, labelled tel-a and
    leased the warm pod's snapshot with no failed API call; that kubeconfig is refused
    deleting a pod, reading Secrets, deleting a NodeCache, creating a ModelDataCache."""
    node = env.kube.rest().get("/api/v1/nodes/tel-a")
    assert any(k.startswith("preheat.dev/rev-") for k in node["metadata"]["labels"])
    inv = json.loads(env.agents["tel-a"].get("/inventory"))["nodes"][0]
    assert any(
        h.startswith(f"pod:{NS}/chat-warm:") for s in inv["snapshots"] for h in s["leased_by"]
    )
    for a in env.agents.values():
        metrics = a.get("/metrics")
        assert not [
            ln for ln in metrics.splitlines() if ln.startswith("preheat_agent_api_errors_total")
        ]
        assert not forbidden_in(a.log.read_text())
    _refused(
        env, env.agent_kubeconfig, "preheat-agent",
        ("delete", "pod", "chat-warm", "-n", NS),
        ("get", "secrets", "-n", NS),
        ("delete", "nodecache", "tel-a"),
    )  # fmt: skip
    cache = {"apiVersion": "preheat.dev/v1alpha1", "kind": "ModelDataCache",
             "metadata": {"name": "stolen"}, "spec": {"source": env.model.url}}  # fmt: skip
    token = env.kube.service_account_token("preheat-system", "preheat-agent")
    assert env.kube.rest(token).call("POST", MDC, cache)[0] == 403


def test_router_did_its_job_without_a_403_and_is_refused_outside_its_role(
    env: Env, router: Router
) -> None:
    """The router (preheat-router-chat's token) took its strategy from the InferenceEndpoint
    and its instances from EndpointSlices with no refusal in its log; that kubeconfig is
    refused listing pods, reading slices in kube-system, deleting the endpoint."""
    (main,) = router.config["variants"]
    assert main["strategy"] == "prefix_aware"
    assert not forbidden_in(router.log), router.log
    _refused(
        env, env.router_kubeconfig, "preheat-router-chat",
        ("get", "pods", "-n", NS),
        ("get", "endpointslices.discovery.k8s.io", "-n", "kube-system"),
        ("delete", "inferenceendpoint", "chat", "-n", NS),
    )  # fmt: skip


def test_recorder_ran_as_the_operator_and_is_refused_outside_its_role(
    env: Env, started: Started
) -> None:
    """The pod start recorder (preheat-operator's token) listed and watched without an
    error; that kubeconfig is refused deleting pods or nodes and reading Secrets."""
    assert started.recorder.api_errors == 0
    _refused(
        env, env.operator_kubeconfig, "preheat-operator",
        ("delete", "nodecache", "tel-a"),  # the agents' object: the operator only reads it
        ("delete", "node", "tel-b"),
        ("get", "secrets", "-n", NS),
    )  # fmt: skip


def test_records_with_credentials_outside_the_operator_role_fail_naming_it(env: Env) -> None:
    """`preheat k8s records` with the router's kubeconfig (no nodes, no pods) exits 2 with
    the refused call, the status and the role to bind, and no traceback."""
    res = CliRunner().invoke(
        cli,
        ["k8s", "records", "--kubeconfig", str(env.router_kubeconfig), "--namespace", NS],
    )
    assert res.exit_code == 2, res.output
    assert "refused list_node (403 Forbidden)" in res.output
    assert "preheat-operator ClusterRole" in res.output and "Traceback" not in res.output
