"""Kubernetes-mode wiring on the rendered objects: engine pods and peers, pod env, the
agents' containerd hosts.toml files, --no-metrics-adapter, kv-event ports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.control.spec import EndpointSpec, parse_endpoint
from preheat.errors import ConfigError
from preheat.runtime.kubernetes.agent_config import AgentConfig
from preheat.runtime.kubernetes.agent_containerd import MARK, ContainerdHosts, registries_of
from preheat.runtime.kubernetes.mirror_config import hosts_toml
from preheat.runtime.kubernetes.render import ENGINE_RULES, endpoint_manifests, render
from preheat.runtime.kubernetes.resources import (
    PodOverrides,
    endpoint_from_object,
    endpoint_object,
)
from preheat.runtime.kubernetes.snapshot_init import peers_for
from preheat.runtime.kubernetes.workload import deployment_body, kv_event_ports, service_body

DIGEST = "cd" * 32
ENDPOINT = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}
SOURCE = "http://127.0.0.1:1/m/preheat-manifest.json"


def _spec(engine: dict[str, Any] | None = None) -> EndpointSpec:
    return parse_endpoint(
        {
            "name": "chat",
            "model": {"source": SOURCE},
            **({"engine": engine} if engine else {}),
            "modelCacheConfig": {"weights": {"enabled": True}},
        },
        origin="test",
    )


def _pod(pod: dict[str, Any] | None = None, *, peers: bool = False, engine: Any = None) -> Any:
    spec = _spec(engine)
    body = deployment_body(
        ENDPOINT, spec, spec.variants[0], name="chat-main", revision="sha256:" + DIGEST,
        digest=DIGEST, source=SOURCE, replicas=1, pod=pod, peers=peers,
    )  # fmt: skip
    return body["spec"]["template"]["spec"]


def test_with_peers_the_init_container_gets_the_token_and_the_nodecaches() -> None:
    """peers=True adds --peer-token-file (an optional, read-only Secret volume) and
    --peers-from-nodecaches to snapshot-init only; peers=False renders neither."""
    pod = _pod(peers=True)
    (init,) = pod["initContainers"]
    args = init["args"]
    assert args[args.index("--peer-token-file") + 1] == "/etc/preheat/peer/token"
    assert "--peers-from-nodecaches" in args
    assert {"name": "peer-token", "mountPath": "/etc/preheat/peer", "readOnly": True} in init[
        "volumeMounts"
    ]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "peer-token"]
    assert vol["secret"] == {"secretName": "preheat-peer-token", "defaultMode": 0o400,
                             "optional": True}  # fmt: skip
    (engine,) = pod["containers"]
    assert all(m["name"] != "peer-token" for m in engine["volumeMounts"])
    off = _pod()
    assert "--peers-from-nodecaches" not in off["initContainers"][0]["args"]
    assert all(v["name"] != "peer-token" for v in off["volumes"])


def test_pod_env_reaches_both_containers_and_survives_the_object_round_trip() -> None:
    """pod.env is appended to the init container's and the engine's env, and an
    InferenceEndpoint written with it parses back to the same overrides."""
    env: list[dict[str, Any]] = [
        {"name": "KUBECONFIG", "value": "/etc/kube/config"},
        {"name": "AWS_SECRET_ACCESS_KEY",
         "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}}},
    ]  # fmt: skip
    pod = _pod({"env": env})
    assert pod["initContainers"][0]["env"][1:] == env
    assert pod["containers"][0]["env"][-2:] == env
    overrides = PodOverrides(env=tuple(env))
    obj = endpoint_object(_spec(), namespace="ml", pod=overrides)
    obj["metadata"]["namespace"] = "ml"
    assert endpoint_from_object(obj)[1] == overrides


@pytest.mark.parametrize(
    ("entry", "word"),
    [({"name": "POD_IP", "value": "x"}, "POD_IP"), ({"name": "A"}, "exactly one")],
)
def test_pod_env_refuses_preheat_names_and_entries_without_a_value(
    entry: dict[str, Any], word: str
) -> None:
    """A pod.env entry that shadows a variable preheat sets, or has neither value nor
    valueFrom, is refused naming the entry."""
    obj = endpoint_object(_spec(), namespace="ml")
    obj["spec"]["pod"] = {"env": [entry]}
    with pytest.raises(ConfigError, match=word):
        endpoint_from_object(obj)


def test_the_engine_service_account_is_bound_to_read_nodecaches() -> None:
    """The system set has the preheat-engine ClusterRole (get/list NodeCaches only); each
    endpoint binds the ServiceAccount its pods run as (default, or the override)."""
    roles = [o for o in render(crds=False) if o["metadata"]["name"] == "preheat-engine"]
    assert [r["kind"] for r in roles] == ["ClusterRole"]
    assert roles[0]["rules"] == [dict(r) for r in ENGINE_RULES]
    assert ENGINE_RULES[0]["verbs"] == ["get", "list"]
    for pod, sa in ((None, "default"), (PodOverrides(service_account_name="llm"), "llm")):
        objs = endpoint_manifests(_spec(), namespace="ml", pod=pod)
        (rb,) = [o for o in objs if o["kind"] == "ClusterRoleBinding"]
        assert rb["metadata"]["name"] == "preheat-engine-ml-chat"
        assert rb["roleRef"]["name"] == "preheat-engine"
        assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "ml"}]


def test_snapshot_init_without_its_optional_token_pulls_from_the_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--peers-from-nodecaches with no token file (the Secret is absent) means no peers,
    said on stderr; an explicit --peer without the file is still an error."""
    assert peers_for(tmp_path / "none", (), True) == (None, {})
    assert "origin only" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot read the peer token"):
        peers_for(tmp_path / "none", ("http://127.0.0.1:1",), False)


def test_snapshot_init_with_nodecaches_it_cannot_list_pulls_from_the_origin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An API server that cannot be reached (a closed port on 127.0.0.1) costs the agents'
    peers, not the pod: the token and the explicit peers stay, stderr says why, and the
    token is not in that line."""
    from preheat.testing.kube import write_kubeconfig
    from preheat.testing.procs import free_port

    token = "t" * 40
    (tmp_path / "token").write_text(token)
    (tmp_path / "ca.crt").write_text("not a certificate\n")
    conf = write_kubeconfig(
        tmp_path / "kubeconfig", server=f"https://127.0.0.1:{free_port()}",
        ca_file=tmp_path / "ca.crt", token=token, user="engine",
    )  # fmt: skip
    monkeypatch.setenv("KUBECONFIG", str(conf))
    got = peers_for(tmp_path / "token", ("http://127.0.0.1:9/",), True)
    assert got == (token, {"peer-0": "http://127.0.0.1:9"})
    err = capsys.readouterr().err
    assert "cannot list NodeCaches" in err and "no agent peers" in err and token not in err


def test_agent_writes_changed_hosts_files_keeps_foreign_ones_and_removes_its_own(
    tmp_path: Path,
) -> None:
    """The first sync writes one hosts.toml per registry (mirror_config's content after
    MARK), a second writes nothing, a node's own file is never touched, and a registry no
    longer wanted loses the agent's file and its empty directory."""
    hosts = ContainerdHosts(tmp_path, "http://127.0.0.1:5001")
    own = tmp_path / "quay.io" / "hosts.toml"
    own.parent.mkdir()
    own.write_text('server = "https://quay.io"\n')
    regs = registries_of(["127.0.0.1:5000/team/app:v1", "ubuntu:22.04", "quay.io/x/y:1", "::"])
    assert regs == {"127.0.0.1:5000", "docker.io", "quay.io"}
    first = hosts.sync(regs)
    assert first.written == ("127.0.0.1:5000", "docker.io") and first.foreign == ("quay.io",)
    body = (tmp_path / "127.0.0.1:5000" / "hosts.toml").read_text()
    assert body == MARK + hosts_toml("127.0.0.1:5000", "http://127.0.0.1:5001")
    mtime = (tmp_path / "docker.io" / "hosts.toml").stat().st_mtime_ns
    assert hosts.sync(regs).written == ()
    assert (tmp_path / "docker.io" / "hosts.toml").stat().st_mtime_ns == mtime
    gone = hosts.sync({"docker.io"})
    assert gone.removed == ("127.0.0.1:5000",) and not (tmp_path / "127.0.0.1:5000").exists()
    assert hosts.sync(set()).removed == ("docker.io",)
    assert own.read_text() == 'server = "https://quay.io"\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quay.io"]


def test_containerd_hosts_need_the_mirror() -> None:
    """--containerd-hosts-dir without --mirror-port is refused naming the fix."""
    with pytest.raises(ConfigError, match="needs --mirror-port"):
        AgentConfig(node="n", store=Path("/s"), containerd_hosts_dir=Path("/etc/c"))


def test_the_daemonset_mounts_containerds_hosts_dir() -> None:
    """The agent DaemonSet passes --containerd-hosts-dir and mounts the host's certs.d."""
    (ds,) = [o for o in render(crds=False) if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--containerd-hosts-dir") + 1] == "/etc/containerd/certs.d"
    vol = next(v for v in pod["volumes"] if v["name"] == "containerd-hosts")
    assert vol["hostPath"]["path"] == "/etc/containerd/certs.d"


def test_no_metrics_adapter_renders_none_of_its_objects() -> None:
    """render(metrics_adapter=False) and `k8s render --no-metrics-adapter` drop the
    adapter's Deployment, Service, APIService and RBAC, and nothing else."""

    def names(objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(o["kind"], o["metadata"]["name"]) for o in objs}

    full, bare = names(render(crds=False)), names(render(crds=False, metrics_adapter=False))
    dropped = full - bare
    assert bare < full
    assert ("APIService", "v1beta1.external.metrics.k8s.io") in dropped
    assert ("Deployment", "preheat-metrics-adapter") in dropped
    assert all("metrics" in n for _, n in dropped), dropped
    out = CliRunner().invoke(main, ["k8s", "render", "--no-metrics-adapter"]).output
    assert "preheat-metrics-adapter" not in out and "preheat-operator" in out


VLLM = {
    "command": "vllm serve {snapshot} --port {port} --kv-events-config "
    + "'"
    + json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
        }
    )
    .replace("{", "{{")
    .replace("}", "}}")  # the template's own braces, escaped
    + "'"
}
PREHEAT = {
    "command": "preheat engine serve --host {host} --port {port} --snapshot {snapshot} "
    "--kv-events 'tcp://{host}:6557?replay=tcp://{host}:6558&hash=builtin'"
}


@pytest.mark.parametrize(
    ("engine", "ports"),
    [
        (VLLM, [("kv-events", 5557), ("kv-replay", 5558)]),
        (PREHEAT, [("kv-events", 6557), ("kv-replay", 6558)]),
        ({"command": "e --port {port} --kv-events=tcp://{host}:7000"}, [("kv-events", 7000)]),
        (None, []),
    ],
    ids=["vllm", "preheat", "no-replay", "simulated"],
)
def test_kv_event_ports_reach_the_pod_and_the_variant_service(
    engine: dict[str, str] | None, ports: list[tuple[str, int]]
) -> None:
    """An engine template that publishes KV events gives its container and the variant's
    Service ports named kv-events/kv-replay (what discovery reads); others get only http."""
    spec = _spec(engine)
    (container,) = _pod(engine=engine)["containers"]
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("http", 8000), *ports]
    svc = service_body(ENDPOINT, spec, "main", "chat-main")
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("http", 80), *ports]
    assert all(p["targetPort"] == p["name"] for p in svc["spec"]["ports"])
    assert kv_event_ports(["x", "--kv-events-config", "not json"]) == []
