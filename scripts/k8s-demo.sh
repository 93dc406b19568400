#!/usr/bin/env bash
# make k8s-demo: the Kubernetes-mode walkthrough of docs/kubernetes.md on the test cluster.
#
# A real v1.20.2 control plane (etcd, kube-apiserver, controller-manager, scheduler) with
# three kubelet stand-in nodes (node-a, node-b: pool=gpu, the cache targets; node-c cold),
# one `preheat agent` per node, `preheat operator` with the rendered operator RBAC, and a
# generated 4 MB model behind nginx. It applies an endpoint (2 replicas, minReady 2),
# scales it to 3 (past the warm nodes: the third pod pulls from the origin on node-c), then
# changes the model version, printing
#     kubectl get inferenceendpoints,modeldatacaches,nodecaches
# at each step. Bounded: every wait has a deadline (about 4 minutes in all on a loaded
# 2-core machine); everything it started is stopped by PID on exit. State: $DEMO_DIR
# (default: a fresh temporary directory, removed at the end unless KEEP=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
bash scripts/build-kube.sh >/dev/null
exec "$PY" - "$@" <<'PYEOF'
import json, os, shutil, sys, tempfile, time, urllib.request
from pathlib import Path

import yaml

from preheat.bench.models import generate_model, write_http_manifest
from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.render import system_manifests
from preheat.runtime.kubernetes.resources import PodOverrides, endpoint_object
from preheat.runtime.procs import start_process
from preheat.store import NodeStore
from preheat.testing.kube import kube_cluster, write_kubeconfig
from preheat.testing.origins import nginx_origin
from preheat.testing.procs import free_port

root = Path(os.environ.get("DEMO_DIR") or tempfile.mkdtemp(prefix="preheat-k8s-demo-"))
bin_ = str(Path(sys.executable).parent / "preheat")
t_start = time.monotonic()


def say(text: str) -> None:
    print(f"\n[{time.monotonic() - t_start:5.1f} s] {text}", flush=True)


def until(what: str, fn, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = fn()
            if out:
                return out
        except (OSError, RuntimeError, KeyError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"k8s-demo: {what} not within {timeout:.0f} s; logs under {root}")


def endpoint(url: str, replicas: int) -> dict:
    spec = parse_endpoint({
        "name": "chat", "model": {"source": url},
        "engine": {"simulated": {"profile": "tiny", "time_scale": 0.05}},
        "replicas": {"min": replicas, "max": 8}, "routing": {"strategy": "prefix_aware"},
        "modelCacheConfig": {"weights": {"enabled": True, "nodes": {"selector": {"pool": "gpu"}},
                                         "minReady": 2, "timeoutSeconds": 120}},
    }, origin="k8s-demo")
    return endpoint_object(spec, namespace="default", pod=PodOverrides(resources={"requests": {"cpu": "3"}}))


for name, seed in (("v1", 1), ("v2", 2)):
    generate_model(root / "origin" / name, 4_000_000, shards=2, seed=seed)
    write_http_manifest(root / "origin" / name)
procs = []
try:
    with nginx_origin(root / "origin", limit_rate=1_000_000) as origin, \
         kube_cluster(root / "kube", crds=True) as kube:
        say(f"control plane up in {kube.timings['total']:.1f} s; adding 3 stand-in nodes")
        for n, labels in (("node-a", {"pool": "gpu"}), ("node-b", {"pool": "gpu"}), ("node-c", {})):
            kube.add_node(n, labels=labels, cpu="4")
        rbac = [m for m in system_manifests() if m["kind"] in
                {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}]
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}

        def sa_conf(name: str) -> Path:
            return write_kubeconfig(root / f"{name}.kubeconfig", server=kube.server, ca_file=kube.ca_file,
                                    token=kube.service_account_token("preheat-system", name), user=name)

        agent_conf = sa_conf("preheat-agent")
        for n in ("node-a", "node-b", "node-c"):
            store = kube.root / "nodes" / n / "var/lib/preheat/store"
            procs.append(start_process([bin_, "agent", "--node", n, "--store", str(store),
                                        "--kubeconfig", str(agent_conf), "--metrics-port", str(free_port()),
                                        "--resync", "1"], root / f"agent-{n}.log", env=env, inherit_env=False))
        op_port = free_port()
        procs.append(start_process([bin_, "operator", "--kubeconfig", str(sa_conf("preheat-operator")),
                                    "--namespace", "default", "--metrics-port", str(op_port),
                                    "--rollout-deadline", "60", "--tick", "1"],
                                   root / "operator.log", env=env, inherit_env=False))
        until("operator /metrics", lambda: urllib.request.urlopen(f"http://127.0.0.1:{op_port}/metrics", timeout=3))
        say("agents and operator running (logs: " + str(root) + ")")

        def show() -> None:
            print(kube.kubectl("get", "inferenceendpoints,modeldatacaches,nodecaches").stdout, end="")
            print(kube.kubectl("get", "pods", "-o", "wide", "-l", "preheat.dev/endpoint=chat").stdout, end="")

        def ready(n: int):
            ep = kube.rest().get("/apis/preheat.dev/v1alpha1/namespaces/default/inferenceendpoints/chat")
            conds = {c["type"]: c["status"] for c in ep.get("status", {}).get("conditions") or ()}
            pods = kube.rest().get("/api/v1/namespaces/default/pods?labelSelector=preheat.dev/endpoint%3Dchat")["items"]
            return conds.get("Ready") == "True" and ep["status"].get("readyReplicas") == n and len(pods) == n

        url1, url2 = origin.url("v1/preheat-manifest.json"), origin.url("v2/preheat-manifest.json")
        t0 = time.monotonic()
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(endpoint(url1, 2)))
        say("applied InferenceEndpoint chat (v1, 2 replicas, minReady 2): the gate holds while nodes fill")
        time.sleep(3)
        show()
        until("2 replicas Ready", lambda: ready(2))
        say(f"Ready after {time.monotonic() - t0:.1f} s (apply -> Ready)")
        show()
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(endpoint(url1, 3)))
        say("scaled to 3: more replicas than warm nodes; the third pod pulls from the origin on node-c")
        until("3 replicas Ready", lambda: ready(3))
        show()
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(endpoint(url2, 2)))
        say("version change to v2 (2 replicas): new cache warmed first, then a surge rollout")
        time.sleep(3)
        show()

        def on_v2():
            digest = NodeStore(root / "probe").resolve(url2)[0]
            pods = kube.rest().get("/api/v1/namespaces/default/pods?labelSelector=preheat.dev/endpoint%3Dchat")["items"]
            caches = kube.rest().get("/apis/preheat.dev/v1alpha1/namespaces/default/modeldatacaches")["items"]
            return ready(2) and all(p["metadata"]["annotations"]["preheat.dev/revision"] == digest for p in pods) \
                and len(caches) == 1
        until("the v2 rollout and the v1 cache's deletion", on_v2, 150)
        say("rolled out; the v1 cache is gone")
        show()
        print(kube.kubectl("get", "events", "--field-selector", "involvedObject.kind=InferenceEndpoint",
                           "--sort-by=.lastTimestamp").stdout)
        say("done")
finally:
    for p in reversed(procs):
        p.stop(10)
    if os.environ.get("KEEP") != "1" and not os.environ.get("DEMO_DIR"):
        shutil.rmtree(root, ignore_errors=True)
PYEOF
