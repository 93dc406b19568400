"""The operator's pure parts: the objects it creates and the status it writes."""

from __future__ import annotations

from preheat.control.spec import parse_endpoint
from preheat.control.state import CacheView, NodeView, ReplicaView, WaitGate
from preheat.runtime.kubernetes import endpoint_status as es
from preheat.runtime.kubernetes.conditions import Condition, merge_conditions, transitions
from preheat.runtime.kubernetes.workload import (
    cache_body,
    cache_name,
    deployment_body,
    engine_argv,
    template_fingerprint,
)

DIGEST = "ab" * 32
ENDPOINT = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}


def _spec(**weights: object):  # type: ignore[no-untyped-def]
    return parse_endpoint(
        {
            "name": "chat",
            "model": {"source": "http://127.0.0.1:1/m/preheat-manifest.json"},
            "modelCacheConfig": {"weights": {"enabled": True, **weights}},
        },
        origin="test",
    )


def _deployment(**kw: object) -> dict:  # type: ignore[type-arg]
    spec = _spec()
    return deployment_body(
        ENDPOINT, spec, spec.variants[0], name="chat-main", revision="sha256:" + DIGEST,
        digest=DIGEST, source="http://u:pw@127.0.0.1:1/m", replicas=3, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_engine_pods_carry_the_label_and_annotation_contract() -> None:
    """Pod labels name preheat/engine/endpoint/variant; annotations the revision and snapshot."""
    tpl = _deployment()["spec"]["template"]
    assert tpl["metadata"]["labels"] == {
        "app.kubernetes.io/name": "preheat",
        "app.kubernetes.io/component": "engine",
        "preheat.dev/endpoint": "chat",
        "preheat.dev/variant": "main",
    }
    ann = tpl["metadata"]["annotations"]
    assert ann["preheat.dev/snapshot"] == DIGEST
    assert ann["preheat.dev/revision"] == "sha256:" + DIGEST


def test_affinity_is_preferred_never_required_and_the_store_is_read_only() -> None:
    """Warm nodes are preferred by their revision label; the hostPath mount is read-only."""
    d = _deployment()
    pod = d["spec"]["template"]["spec"]
    aff = pod["affinity"]["nodeAffinity"]
    assert list(aff) == ["preferredDuringSchedulingIgnoredDuringExecution"]
    term = aff["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]
    assert term["matchExpressions"] == [
        {"key": "preheat.dev/rev-" + DIGEST[:12], "operator": "Exists"}
    ]
    (engine,) = pod["containers"]
    assert {"name": "store", "mountPath": "/var/lib/preheat/store", "readOnly": True} in engine[
        "volumeMounts"
    ]
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert d["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_the_source_stays_out_of_the_init_containers_args() -> None:
    """A credential in the source URL is in env, not in args that listings print."""
    (init,) = _deployment()["spec"]["template"]["spec"]["initContainers"]
    assert not any("pw" in a for a in init["args"])
    assert init["args"][0] == "snapshot-init" and "$(PREHEAT_SOURCE)" in init["args"]


def test_command_engines_get_the_pod_local_snapshot_and_port() -> None:
    """The {snapshot}/{port}/{host}/{model} template is filled for a pod."""
    spec = parse_endpoint(
        {"name": "chat", "model": {"source": "file:///m"},
         "engine": {"command": "llama-server -m {snapshot}/m.gguf --host {host} --port {port} -a {model}"}},
        origin="t",
    )  # fmt: skip
    argv = engine_argv(spec.variants[0], "chat")
    assert argv == ["llama-server", "-m", "/weights/model/m.gguf", "--host", "$(POD_IP)",
                    "--port", "8000", "-a", "chat"]  # fmt: skip


def test_cache_objects_target_the_configured_nodes_and_fit_dns_names() -> None:
    """The cache body takes modelCacheConfig's selector, minReady and pin; names stay short."""
    body = cache_body(ENDPOINT, _spec(nodes={"selector": {"pool": "gpu"}}, minReady=2, pin=True),
                      "sha256:" + DIGEST, "http://o/m")  # fmt: skip
    assert body["spec"]["nodes"] == {"selector": {"pool": "gpu"}}
    assert body["spec"]["minReady"] == 2 and body["spec"]["pin"] is True
    assert cache_name("chat", "sha256:" + DIGEST) == "chat-" + DIGEST[:12]
    long = cache_name("x" * 70, DIGEST)
    assert len(long) <= 63 and long != cache_name("x" * 71, DIGEST)


def test_an_engine_change_changes_the_template_fingerprint() -> None:
    """A new engine rolls the pods (the version changes) without a new cache."""
    a = _spec().variants[0]
    b = parse_endpoint(
        {"name": "chat", "model": {"source": "http://127.0.0.1:1/m/preheat-manifest.json"},
         "engine": {"simulated": {"profile": "tiny", "time_scale": 2}}}, origin="t",
    ).variants[0]  # fmt: skip
    assert template_fingerprint(a) != template_fingerprint(b)


def test_conditions_keep_their_transition_time_while_status_holds() -> None:
    """Only a status change moves lastTransitionTime; transitions() lists real changes."""
    one = merge_conditions([], [Condition("Ready", False, "Waiting", "a")], generation=1, now="t1")
    two = merge_conditions(one, [Condition("Ready", False, "Waiting", "b")], generation=2, now="t2")
    assert two[0]["lastTransitionTime"] == "t1" and two[0]["observedGeneration"] == 2
    assert transitions(one, two) == []
    three = merge_conditions(
        two, [Condition("Ready", True, "AllReady", "c")], generation=2, now="t3"
    )
    assert three[0]["lastTransitionTime"] == "t3"
    assert [c["reason"] for c in transitions(two, three)] == ["AllReady"]


def test_endpoint_status_says_why_the_gate_holds() -> None:
    """A closed gate is CacheReady=False WaitingForNodes naming the missing nodes."""
    from preheat.control.state import Desired, DesiredVariant, WeightsPolicy

    spec = _spec(minReady=2)
    rev = "sha256:" + DIGEST
    desired = Desired("chat", (DesiredVariant("main", rev, 1, 2),), WeightsPolicy(True, 2))
    nodes = (NodeView("a", cache=((rev, CacheView("ready")),)), NodeView("b"))
    view = es.EndpointView(
        generation=3, spec=spec, resolved={}, resolved_generation=3, memory={}, nodes=nodes,
        replicas=(ReplicaView("p", "main", "old", "a", "ready"),), desired=desired,
        deployments={}, gates={"main": WaitGate("main", rev, 1, 2, ("b",))}, unschedulable={},
    )  # fmt: skip
    out = es.endpoint_status(view, {}, now="t")
    conds = {c["type"]: c for c in out["conditions"]}
    assert conds["CacheReady"]["status"] == "False"
    assert (
        conds["CacheReady"]["reason"] == "WaitingForNodes"
        and "waiting on b" in conds["CacheReady"]["message"]
    )
    assert conds["Ready"]["status"] == "False" and conds["Progressing"]["status"] == "True"
    assert out["observedGeneration"] == 3 and out["warmNodes"] == 1
    assert all(c["observedGeneration"] == 3 for c in out["conditions"])


async def test_the_loop_commits_after_every_pass_even_with_nothing_to_plan() -> None:
    """``commit`` (the Kubernetes executor's status write) runs after each pass, also
    when ``observe`` had nothing to plan; an executor without one is left alone."""
    from preheat.runtime.fleetlog import FleetLog
    from preheat.runtime.reconcile import ReconcileLoop

    class Committing:
        def __init__(self) -> None:
            self.commits = 0

        async def observe(self) -> None:
            return None

        async def commit(self) -> None:
            self.commits += 1

    ex = Committing()
    loop = ReconcileLoop(ex, FleetLog(None))  # type: ignore[arg-type]
    await loop.once()
    await loop.once()
    assert ex.commits == 2 and loop.log.errors == 0


def test_the_deployment_records_the_spec_replica_count_it_was_given() -> None:
    """The annotation replica_count reads says which spec count was applied."""
    from preheat.runtime.kubernetes.workload import SPEC_REPLICAS_ANNOTATION

    assert _deployment()["metadata"]["annotations"] == {SPEC_REPLICAS_ANNOTATION: "3"}
    dep = _deployment(spec_replicas=2)
    assert dep["metadata"]["annotations"][SPEC_REPLICAS_ANNOTATION] == "2"
    assert dep["spec"]["replicas"] == 3
