"""The image rows of a NodeCache, the ModelImageCache status, and start records'
`image_source` / `weights_source` from the agents' arrival times (pure functions)."""

from __future__ import annotations

from typing import Any

from preheat.runtime.kubernetes.agent_images_status import (
    HeldImage,
    PendingImage,
    add_revision_ready_at,
    image_cache_status,
    image_held_by_node,
    image_key,
    image_rows,
)
from preheat.runtime.kubernetes.podrecords_core import (
    node_snapshot_from_nodecache,
    parse_time,
    start_record_from_pod,
)

IMG = "reg.test:5000/team/app:v1"
DIGEST = "sha256:" + "ab" * 32


def _nodecache(state: str = "Ready", ready_at: str = "2026-12-01T13:00:00Z") -> dict[str, Any]:
    row = {"image": IMG, "digest": DIGEST, "state": state, "bytes": 10, "readyAt": ready_at}
    return {"metadata": {"name": "n1"}, "spec": {"node": "n1"}, "status": {"images": [row]}}


def _pod(created: str, image: str = IMG) -> dict[str, Any]:
    return {
        "metadata": {"name": "chat-1", "creationTimestamp": created,
                     "labels": {"preheat.dev/endpoint": "chat"},
                     "annotations": {"preheat.dev/snapshot": "d" * 64,
                                     "preheat.dev/revision": "rev1"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "engine", "image": image}]},
        "status": {
            "conditions": [{"type": "Ready", "status": "True",
                            "lastTransitionTime": "2026-12-01T13:05:09Z"}],
            "containerStatuses": [{"name": "engine", "restartCount": 0,
                                   "state": {"running": {"startedAt": "2026-12-01T13:05:05Z"}}}],
        },
    }  # fmt: skip


def test_image_key_normalises_docker_hub_and_keeps_digest_refs() -> None:
    """Short Docker Hub names and digest refs map to one comparable key."""
    assert image_key("nginx") == "docker.io/library/nginx:latest"
    assert image_key(f"reg.test:5000/a@{DIGEST}") == f"reg.test:5000/a@{DIGEST}"
    assert image_key(IMG) == IMG


def test_rows_list_held_images_then_pending_ones_with_reasons_redacted() -> None:
    """A held image is Ready with readyAt and its reference count; a wanted image not held
    is Pulling or Failed, its message without credentials; a held one is not repeated."""
    held = [HeldImage("reg.test:5000/team/app", "v1", DIGEST, 100, "2026-12-01T13:00:00Z", 2)]
    pending = [
        PendingImage(IMG, "Pulling", 5),
        PendingImage("reg.test:5000/x:1", "Failed", 0, "GET https://u:secret@reg.test/x: 503"),
    ]
    rows = image_rows(held, pending)
    assert rows[0] == {"image": IMG, "digest": DIGEST, "bytes": 100, "state": "Ready",
                       "readyAt": "2026-12-01T13:00:00Z", "references": 2}  # fmt: skip
    assert len(rows) == 2 and rows[1]["state"] == "Failed"
    assert "secret" not in rows[1]["message"] and "503" in rows[1]["message"]


def test_image_cache_status_is_ready_on_all_targets_degraded_on_a_failure() -> None:
    """readyNodes counts Ready target nodes; Ready needs all of them; a Failed node makes
    Degraded True; transition times hold while a state holds."""
    caches = {"n1": _nodecache(), "n2": _nodecache("Failed")}
    caches["n2"]["status"]["images"][0]["message"] = "registry down"
    st = image_cache_status(image=IMG, generation=1, target_nodes=["n2", "n1"],
                            nodecaches=caches, now="T1")  # fmt: skip
    assert st["readyNodes"] == 1 and st["targetNodes"] == ["n1", "n2"]
    assert st["digest"] == DIGEST
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["Ready"]["status"] == "False" and cond["Degraded"]["status"] == "True"
    assert "registry down" in cond["Degraded"]["message"]
    caches["n2"] = _nodecache()
    again = image_cache_status(image=IMG, generation=1, target_nodes=["n1", "n2"],
                               nodecaches=caches, now="T2", previous=st)  # fmt: skip
    cond = {c["type"]: c for c in again["conditions"]}
    assert cond["Ready"]["status"] == "True" and cond["Ready"]["lastTransitionTime"] == "T2"
    assert again["nodes"][0]["lastTransitionTime"] == "T1"  # n1 stayed Ready
    none = image_cache_status(image=IMG, generation=1, target_nodes=[], nodecaches={}, now="T")
    assert none["conditions"][0]["reason"] == "NoTargetNodes"


def test_image_source_is_cache_only_when_the_node_had_it_before_the_pod() -> None:
    """`cache` for a pod created after the node's readyAt, `pull` for one created before
    it or for an image the node lacks, None for a node without a NodeCache."""
    caches = {"n1": _nodecache(ready_at="2026-12-01T13:00:00Z")}
    assert image_held_by_node(_pod("2026-12-01T13:05:00Z"), caches) is True
    assert image_held_by_node(_pod("2026-12-01T12:59:00Z"), caches) is False
    assert image_held_by_node(_pod("2026-12-01T13:05:00Z", "other:1"), caches) is False
    assert image_held_by_node(_pod("2026-12-01T13:05:00Z"), {}) is None
    rec = start_record_from_pod(_pod("2026-12-01T13:05:00Z"), node=None, image_held=True)
    assert rec is not None and rec.image_source == "cache"
    rec = start_record_from_pod(_pod("2026-12-01T13:05:00Z"), node=None, image_held=False)
    assert rec is not None and rec.image_source == "pull"


def test_a_snapshot_that_arrived_after_the_pod_started_is_origin() -> None:
    """With the agent's per-revision readyAt, a revision that arrived after the pod started
    makes weights_source origin, even though the node holds it now (one-shot pass)."""
    status: dict[str, Any] = {
        "revisions": [{"revision": "rev1", "state": "Ready", "bytes": 7}],
        "conditions": [{"type": "Ready", "status": "True",
                        "lastTransitionTime": "2026-12-01T12:00:00Z"}],
    }  # fmt: skip
    add_revision_ready_at(status, {"rev1": "2026-12-01T13:06:00Z"})
    assert status["revisions"][0]["readyAt"] == "2026-12-01T13:06:00Z"
    snap = node_snapshot_from_nodecache({"status": status}, snapshot=None, revision="rev1")
    assert snap.ready_at == parse_time("2026-12-01T13:06:00Z")
    rec = start_record_from_pod(_pod("2026-12-01T13:05:00Z"), node=snap)
    assert rec is not None and rec.weights_source == "origin"
    add_revision_ready_at(status, {"rev1": "2026-12-01T13:01:00Z"})
    snap = node_snapshot_from_nodecache({"status": status}, snapshot=None, revision="rev1")
    rec = start_record_from_pod(_pod("2026-12-01T13:05:00Z"), node=snap)
    assert rec is not None and rec.weights_source == "cache"
