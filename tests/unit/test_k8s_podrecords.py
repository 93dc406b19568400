"""Start records from pod objects (podrecords_core, podrecords_context): pure, no cluster.

The pod JSON below is what the test cluster's API server returned for an engine pod with a
`weights` init container, run by the kubelet stand-in (`kubectl get pod -o json`, trimmed
to the fields the recorder reads), once Ready and again after its engine was SIGKILLed.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import pytest

from preheat.runtime.kubernetes.nodecache_status import HeldRevision, nodecache_status
from preheat.runtime.kubernetes.podrecords_context import (
    PeerPod,
    node_is_new,
    peer_from_pod,
    start_reason,
)
from preheat.runtime.kubernetes.podrecords_core import (
    EngineStartup,
    NodeSnapshot,
    engine_startup_from_json,
    node_snapshot_from_inventory,
    node_snapshot_from_nodecache,
    parse_time,
    start_record_from_pod,
)
from preheat.store import NodeStore
from preheat.telemetry.classify import StartReason
from preheat.telemetry.inventory import inventory_from_store, inventory_to_json
from preheat.telemetry.records import EventClass, StartRecord

DIGEST = "ab" * 32
READY_POD: dict[str, Any] = json.loads(
    """{"metadata": {"name": "chat-main-abc", "namespace": "default",
  "uid": "8428dfa9-247b-448d-b35f-e65971c08f96", "creationTimestamp": "2026-12-01T12:59:31Z",
  "labels": {"app.kubernetes.io/component": "engine", "app.kubernetes.io/name": "preheat",
             "preheat.dev/endpoint": "chat", "preheat.dev/variant": "main"},
  "annotations": {"preheat.dev/revision": "rev1",
    "preheat.dev/snapshot": "sha256:abababababababababababababababababababababababababababababababab"}},
 "spec": {"nodeName": "node-a"},
 "status": {"phase": "Running", "conditions": [
   {"type": "Initialized", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-01T12:59:32Z"},
   {"type": "ContainersReady", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-01T12:59:34Z"},
   {"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-01T12:59:34Z"},
   {"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-12-01T12:59:31Z"}],
  "hostIP": "127.190.0.1", "podIP": "127.190.1.2", "podIPs": [{"ip": "127.190.1.2"}],
  "startTime": "2026-12-01T12:59:31Z",
  "initContainerStatuses": [{"name": "weights", "state": {"terminated": {"exitCode": 0,
     "reason": "Completed", "startedAt": "2026-12-01T12:59:31Z", "finishedAt": "2026-12-01T12:59:32Z"}},
     "lastState": {}, "ready": false, "restartCount": 0, "image": "x", "imageID": "",
     "containerID": "standin://13999", "started": false}],
  "containerStatuses": [{"name": "engine", "state": {"running": {"startedAt": "2026-12-01T12:59:32Z"}},
     "lastState": {}, "ready": true, "restartCount": 0, "image": "x", "imageID": "",
     "containerID": "standin://14001", "started": true}],
  "qosClass": "BestEffort"}}"""
)
#: The engine's GET /startup of that pod.
STARTUP = {
    "stages": {
        "runtime_started": 1796129972.890098,
        "weights_loaded": 1796129973.2949102,
        "healthy": 1796129973.2951572,
    },
    "ready": True,
    "weights_bytes": 1000,
    "snapshot": "/tmp/k8sobs/capture/nodes/node-a/var/lib/preheat/store/snap",
}


def ts(hms: str) -> float:
    return datetime.fromisoformat(f"2026-12-01T{hms}+00:00").timestamp()


def restarted_pod() -> dict[str, Any]:
    """The same pod after its engine was killed once (restartCount 1, Ready again)."""
    pod = copy.deepcopy(READY_POD)
    conds = {c["type"]: c for c in pod["status"]["conditions"]}
    conds["Ready"]["lastTransitionTime"] = conds["ContainersReady"]["lastTransitionTime"] = (
        "2026-12-01T12:59:36Z"
    )
    engine = pod["status"]["containerStatuses"][0]
    engine["state"] = {"running": {"startedAt": "2026-12-01T12:59:35Z"}}
    engine["restartCount"] = 1
    return pod


def pending_pod() -> dict[str, Any]:
    """The pod while its init container still runs (not Ready)."""
    pod = copy.deepcopy(READY_POD)
    for c in pod["status"]["conditions"]:
        if c["type"] != "PodScheduled":
            c["status"] = "False"
    pod["status"]["initContainerStatuses"][0]["state"] = {
        "running": {"startedAt": "2026-12-01T12:59:31Z"}
    }
    pod["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "PodInitializing"}}
    return pod


def test_warm_node_pod_reads_weights_from_cache_stage_by_stage() -> None:
    """A pod on a node that held the snapshot before it started: every stage from the pod's
    timestamps, weights from the cache with the agent's bytes, class cold_pod_warm_node."""
    rec = start_record_from_pod(
        READY_POD, node=NodeSnapshot(True, ready_at=ts("12:59:00"), size_bytes=3_000_000)
    )
    assert rec is not None
    assert (rec.endpoint, rec.variant, rec.replica, rec.node, rec.revision) == (
        "chat", "main", "chat-main-abc", "node-a", "rev1",
    )  # fmt: skip
    assert rec.scheduled == ts("12:59:31")
    assert rec.image_ready == ts("12:59:31")
    assert rec.weights_ready == ts("12:59:32")
    assert rec.runtime_started == ts("12:59:32")
    assert rec.weights_loaded is None
    assert rec.healthy == ts("12:59:34")
    assert rec.ready_seconds == 3.0
    assert rec.weights_source == "cache" and rec.cache_hit
    assert dict(rec.bytes_from) == {"cache": 3_000_000}
    assert rec.event_class is EventClass.COLD_POD_WARM_NODE
    assert rec.ok and rec.restart_count == 0 and rec.image_source is None


def test_cold_node_pod_reads_weights_from_origin_with_engine_stages() -> None:
    """A pod on a node without the snapshot: origin, the engine's weights_bytes, class
    new_node, and the engine's sub-second /startup stages between the pod's."""
    rec = start_record_from_pod(
        READY_POD, node=NodeSnapshot(False), startup=engine_startup_from_json(STARTUP)
    )
    assert rec is not None
    assert rec.weights_source == "origin" and not rec.cache_hit
    assert dict(rec.bytes_from) == {"origin": 1000}
    assert rec.event_class is EventClass.NEW_NODE
    assert rec.runtime_started == pytest.approx(1796129972.890098)
    assert rec.weights_loaded == pytest.approx(1796129973.2949102)
    assert rec.weights_ready is not None and rec.runtime_started >= rec.weights_ready
    assert rec.healthy == ts("12:59:34")
    assert list(rec.stage_durations()) == [
        "image_ready", "weights_ready", "runtime_started", "weights_loaded", "healthy",
    ]  # fmt: skip


def test_snapshot_that_arrived_after_the_weights_step_began_is_origin() -> None:
    """The agent finished warming after the init container began (it pulled itself)."""
    late = NodeSnapshot(True, ready_at=ts("12:59:33"), size_bytes=10)
    rec = start_record_from_pod(READY_POD, node=late)
    assert rec is not None and rec.weights_source == "origin"
    on_time = NodeSnapshot(True, ready_at=ts("12:59:31"), size_bytes=10)
    rec = start_record_from_pod(READY_POD, node=on_time)
    assert rec is not None and rec.weights_source == "cache"


def test_container_restart_is_a_warm_restart_of_its_own() -> None:
    """restartCount 1: scheduled at the new container's start, healthy at the new Ready,
    weights from the node, class warm_restart, restart_count 1."""
    rec = start_record_from_pod(restarted_pod(), node=NodeSnapshot(False))
    assert rec is not None
    assert rec.event_class is EventClass.WARM_RESTART
    assert rec.restart_count == 1
    assert rec.scheduled == ts("12:59:35") and rec.healthy == ts("12:59:36")
    assert rec.weights_source == "cache"


def test_pod_still_starting_gives_no_record_until_it_fails() -> None:
    """Not Ready: no record; deleted before Ready: a failed record without healthy."""
    assert start_record_from_pod(pending_pod(), node=NodeSnapshot(True)) is None
    rec = start_record_from_pod(
        pending_pod(), node=NodeSnapshot(True), failure="deleted before it became Ready"
    )
    assert rec is not None and not rec.ok and rec.healthy is None
    assert rec.failure == "deleted before it became Ready"
    assert rec.image_ready == ts("12:59:31") and rec.runtime_started is None


def test_failed_pod_and_crashing_init_container_are_failures_with_redacted_reasons() -> None:
    """Phase Failed or an init container exiting non-zero again and again is a failure;
    a credential in the pod's message does not reach the record."""
    pod = pending_pod()
    pod["status"]["phase"] = "Failed"
    pod["status"]["message"] = "pull https://user:hunter2@origin.example/m failed"
    rec = start_record_from_pod(pod, node=None)
    assert rec is not None and rec.failure is not None
    assert "hunter2" not in rec.failure and "origin.example" in rec.failure
    pod = pending_pod()
    init = pod["status"]["initContainerStatuses"][0]
    init["state"] = {"terminated": {"exitCode": 3, "startedAt": "2026-12-01T12:59:31Z",
                                    "finishedAt": "2026-12-01T12:59:32Z"}}  # fmt: skip
    init["restartCount"] = 2
    rec = start_record_from_pod(pod, node=None)
    assert rec is not None and rec.failure is not None and "code 3" in rec.failure


def test_records_round_trip_through_jsonl() -> None:
    """A pod's record encodes to one JSON line and decodes to the same record."""
    rec = start_record_from_pod(READY_POD, node=NodeSnapshot(True, size_bytes=5))
    assert rec is not None
    assert StartRecord.from_json(rec.to_json()) == rec


def test_node_snapshot_from_a_real_nodecache_status() -> None:
    """The status the agent writes (nodecache_status) says held, bytes and since when."""
    status = nodecache_status(
        generation=1,
        now="2026-12-01T12:59:10Z",
        capacity_bytes=None,
        free_bytes=10**9,
        held=[HeldRevision(DIGEST, "rev1", "http://o/m", 3_000_000, False, 0, None)],
        pending=[],
        wanted=["rev1"],
        eviction_order=[DIGEST],
        last_failure=None,
    )
    obj = {"metadata": {"name": "node-a"}, "status": status}
    got = node_snapshot_from_nodecache(obj, snapshot=f"sha256:{DIGEST}", revision="rev1")
    assert got == NodeSnapshot(True, ts("12:59:10"), 3_000_000)
    assert node_snapshot_from_nodecache(obj, snapshot="sha256:" + "cd" * 32, revision="r2") == (
        NodeSnapshot(False)
    )
    assert node_snapshot_from_nodecache(None, snapshot=None, revision="rev1") == NodeSnapshot(False)


def test_node_snapshot_from_an_agent_inventory(tmp_path: Any) -> None:
    """The /inventory JSON of a real store names the snapshot by manifest digest."""
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(b"w" * 4096)
    store = NodeStore(tmp_path / "store")
    res = store.pull(src.as_uri())
    inv = json.loads(inventory_to_json([inventory_from_store("node-a", store)]))
    digest = store.snapshots()[0].digest
    got = node_snapshot_from_inventory(inv, "node-a", snapshot=f"sha256:{digest}", revision=None)
    assert got.held and got.size_bytes == 4096 and got.ready_at is None
    assert not node_snapshot_from_inventory(inv, "node-b", snapshot=digest, revision=None).held
    assert res.revision


def test_parse_time_reads_api_timestamps_and_names_bad_ones() -> None:
    """Z, offsets and fractions parse; junk is named with an example."""
    assert parse_time("2026-12-01T12:59:31Z") == ts("12:59:31")
    assert parse_time("2026-12-01T12:59:31.5+00:00") == ts("12:59:31") + 0.5
    assert parse_time(None) is None
    with pytest.raises(ValueError, match="not RFC 3339"):
        parse_time("yesterday")


def peer(name: str, created: float, **kw: Any) -> PeerPod:
    return PeerPod(
        uid=name, name=name, endpoint="chat", variant=kw.pop("variant", "main"),
        revision=kw.pop("revision", "rev1"), node=kw.pop("node", "node-a"), created=created, **kw,
    )  # fmt: skip


def test_start_reason_initial_scale_out_rollout_node_loss() -> None:
    """First deploy is initial; one more pod beside Ready ones is scale_out; a new revision
    while old pods run is rollout (every pod of it); a replacement after a lost node is
    node_loss; a pod of another variant or endpoint never counts."""
    a, b = peer("a", 100.0, ready_since=110.0), peer("b", 100.0)
    assert start_reason(b, [a, b]) is StartReason.INITIAL
    c = peer("c", 200.0)
    assert start_reason(c, [a, b, c]) is StartReason.SCALE_OUT
    other = peer("o", 50.0, variant="canary", ready_since=60.0)
    assert start_reason(b, [other]) is StartReason.INITIAL
    new1, new2 = peer("n1", 300.0, revision="rev2"), peer("n2", 320.0, revision="rev2")
    old = [a, peer("b", 100.0, ready_since=111.0)]
    assert start_reason(new1, [*old, new1]) is StartReason.ROLLOUT
    assert start_reason(new2, [*old, new1, new2]) is StartReason.ROLLOUT
    done = [peer("a", 100.0, ready_since=110.0, deleted_at=350.0), new1, new2]
    later = peer("n3", 500.0, revision="rev2")
    assert start_reason(later, [*done, peer("n1", 300.0, revision="rev2", ready_since=310.0)]) is (
        StartReason.SCALE_OUT
    )
    lost = peer("r", 400.0, node="node-b")
    assert start_reason(lost, [a, lost], lost_nodes={"node-a": 380.0}) is StartReason.NODE_LOSS
    assert start_reason(lost, [a, lost], lost_nodes={"node-a": 380.0 - 2000}) is (
        StartReason.SCALE_OUT
    )


def test_node_is_new_only_after_the_endpoint_started_and_before_any_pod_there() -> None:
    """A node created after the endpoint's first pod is new until it hosted one."""
    a = peer("a", 100.0)
    b = peer("b", 200.0, node="node-n")
    assert node_is_new(b, [a, b], node_created=150.0)
    assert not node_is_new(b, [a, b], node_created=90.0)
    c = peer("c", 300.0, node="node-n")
    assert not node_is_new(c, [a, b, c], node_created=150.0)
    assert not node_is_new(a, [a], node_created=150.0)


def test_peer_from_a_real_pod_and_its_reason_drives_the_class() -> None:
    """peer_from_pod reads created, Ready and node; a scale_out reason on a warm node gives
    class scale_out, on a cold node still scale_out (the source label tells them apart)."""
    p = peer_from_pod(READY_POD)
    assert (p.created, p.ready_since, p.node, p.revision) == (
        ts("12:59:31"), ts("12:59:34"), "node-a", "rev1",
    )  # fmt: skip
    for node, source in ((NodeSnapshot(True), "cache"), (NodeSnapshot(False), "origin")):
        rec = start_record_from_pod(READY_POD, node=node, reason=StartReason.SCALE_OUT)
        assert rec is not None
        assert (rec.event_class, rec.weights_source) == (EventClass.SCALE_OUT, source)
    rec = start_record_from_pod(READY_POD, node=NodeSnapshot(True), reason=StartReason.ROLLOUT)
    assert rec is not None and rec.event_class is EventClass.NEW_VERSION
    assert EngineStartup() == engine_startup_from_json("not json")
