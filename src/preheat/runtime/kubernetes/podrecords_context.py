"""Why an engine pod started: its ``StartReason`` from the endpoint's other pods (pure).

Local mode knows why it starts a replica; in Kubernetes the Deployment controller decides,
so the reason is read back from what the recorder saw of the endpoint's pods (``PeerPod``:
created, ready since, deleted at, node, revision) and of the nodes. For a pod created at
``c`` (rules in order; a peer is *alive at c* when created before ``c`` and not deleted
before ``c``):

1. ``node_loss``  a peer of the same variant ran on a node that was lost (NotReady or
                  deleted) at most ``NODE_LOSS_WINDOW_S`` before ``c``;
2. ``rollout``    a peer of the same variant alive at ``c`` has another revision and was
                  created before the first pod of this pod's revision (a rolling update is
                  replacing it);
3. ``scale_out``  a peer of the same variant alive at ``c`` was Ready before ``c`` (the
                  endpoint was serving and got one more replica, or a deleted pod was
                  replaced);
4. ``initial``    otherwise (the first deployment).

``node_is_new``: the node was created after the endpoint's first pod and no earlier pod
of the endpoint ran on it (local mode's ``node add`` while the endpoint runs).

Container restarts are not decided here: ``restartCount`` > 0 is always ``restart``.
What the recorder never saw (pods deleted before it started) cannot count, so a recorder
started after a rollout finished reads its pods as ``initial`` or ``scale_out``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from preheat.runtime.kubernetes.podrecords_core import (
    ENDPOINT_LABEL,
    VARIANT_LABEL,
    parse_time,
    pod_revision,
)
from preheat.telemetry.classify import StartReason

__all__ = ["NODE_LOSS_WINDOW_S", "PeerPod", "node_is_new", "peer_from_pod", "start_reason"]

#: A replacement created this long after its node was lost still counts as recovery (the
#: node-lifecycle controller evicts after 300 s of NotReady, plus the scheduler's time).
NODE_LOSS_WINDOW_S = 900.0


@dataclass(frozen=True, slots=True)
class PeerPod:
    """One engine pod as the event-class rules need it."""

    uid: str
    name: str
    endpoint: str
    variant: str
    revision: str
    node: str | None
    created: float
    ready_since: float | None = None
    deleted_at: float | None = None

    def alive_at(self, t: float) -> bool:
        return self.created < t and (self.deleted_at is None or self.deleted_at >= t)


def peer_from_pod(pod: Mapping[str, Any], *, deleted_at: float | None = None) -> PeerPod:
    """A ``PeerPod`` from a pod object; ``deleted_at`` defaults to its deletionTimestamp."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    ready: Mapping[str, Any] = next(
        (c for c in (pod.get("status") or {}).get("conditions") or () if c.get("type") == "Ready"),
        {},
    )
    created = parse_time(meta.get("creationTimestamp"))
    if created is None:
        raise ValueError(f"pod {meta.get('name')!r} has no metadata.creationTimestamp")
    return PeerPod(
        uid=str(meta.get("uid") or meta.get("name")),
        name=str(meta.get("name")),
        endpoint=str(labels.get(ENDPOINT_LABEL) or ""),
        variant=str(labels.get(VARIANT_LABEL) or "main"),
        revision=pod_revision(pod),
        node=(pod.get("spec") or {}).get("nodeName"),
        created=created,
        ready_since=parse_time(ready.get("lastTransitionTime"))
        if ready.get("status") == "True"
        else None,
        deleted_at=deleted_at
        if deleted_at is not None
        else parse_time(meta.get("deletionTimestamp")),
    )


def start_reason(
    pod: PeerPod, peers: Iterable[PeerPod], *, lost_nodes: Mapping[str, float] | None = None
) -> StartReason:
    """The reason for ``pod``'s first start (rules in the module header). ``lost_nodes``:
    node -> when it went NotReady or was deleted."""
    c = pod.created
    same = [
        p
        for p in peers
        if p.uid != pod.uid and p.endpoint == pod.endpoint and p.variant == pod.variant
    ]
    for p in same:
        lost = (lost_nodes or {}).get(p.node or "")
        if lost is not None and p.created < c and 0 <= c - lost <= NODE_LOSS_WINDOW_S:
            return StartReason.NODE_LOSS
    first_of_mine = min([c, *(p.created for p in same if p.revision == pod.revision)])
    alive = [p for p in same if p.alive_at(c)]
    if any(p.revision != pod.revision and p.created < first_of_mine for p in alive):
        return StartReason.ROLLOUT
    if any(p.ready_since is not None and p.ready_since <= c for p in alive):
        return StartReason.SCALE_OUT
    return StartReason.INITIAL


def node_is_new(pod: PeerPod, peers: Iterable[PeerPod], node_created: float | None) -> bool:
    """Whether ``pod``'s node joined after the endpoint's first pod and hosted none of its
    pods before this one."""
    if pod.node is None or node_created is None:
        return False
    mine = [p for p in peers if p.endpoint == pod.endpoint and p.uid != pod.uid]
    if not mine or node_created <= min(p.created for p in mine):
        return False
    return not any(p.node == pod.node and p.created < pod.created for p in mine)
