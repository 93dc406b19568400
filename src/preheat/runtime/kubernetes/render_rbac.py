"""The least-privilege rules of every Kubernetes-mode component and the RBAC objects
``preheat k8s render`` builds from them (:mod:`.render` re-exports the rules).

Each rule sits next to what the component calls; the tests apply these Roles to
ServiceAccounts on the real API server and check both what is allowed and a 403 for a
verb outside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from preheat.runtime.kubernetes.crds import GROUP

__all__ = [
    "AGENT_PEER_RULES",
    "AGENT_RULES",
    "ENGINE_RULES",
    "OPERATOR_RULES",
    "OPERATOR_SETTINGS_RULES",
    "ROUTER_RULES",
    "Rule",
]

_READ = ["get", "list", "watch"]
_WRITE = ["create", "update", "patch", "delete"]
_STATUS = ["get", "update", "patch"]

Rule = dict[str, list[str]]


def _rule(groups: Sequence[str], resources: Sequence[str], verbs: Sequence[str]) -> Rule:
    return {"apiGroups": list(groups), "resources": list(resources), "verbs": list(verbs)}


#: The operator: reconciles endpoints into caches and Deployments, labels nodes, emits Events.
OPERATOR_RULES: tuple[Rule, ...] = (
    _rule([GROUP], ["inferenceendpoints"], [*_READ, "update", "patch"]),
    _rule([GROUP], ["inferenceendpoints/status"], _STATUS),
    _rule([GROUP], ["inferenceendpoints/finalizers"], ["update"]),
    _rule([GROUP], ["modeldatacaches", "modelimagecaches"], [*_READ, *_WRITE]),
    _rule(
        [GROUP],
        ["modeldatacaches/status", "modelimagecaches/status", "revocations/status"],
        _STATUS,
    ),
    _rule([GROUP], ["nodecaches", "revocations"], _READ),
    _rule(["apps"], ["deployments"], [*_READ, *_WRITE]),
    _rule([""], ["services"], [*_READ, *_WRITE]),
    # delete: a pod on a lost node is deleted at once so its ReplicaSet replaces it.
    _rule([""], ["pods"], [*_READ, "delete"]),
    _rule([""], ["nodes"], [*_READ, "patch"]),
    _rule(["", "events.k8s.io"], ["events"], ["create", "patch"]),
    # kopf: discover the CRDs and namespaces it serves (runs with --standalone: no peering).
    _rule(["apiextensions.k8s.io"], ["customresourcedefinitions"], _READ),
    _rule([""], ["namespaces"], _READ),
)

#: The node agent: owns its node's store and NodeCache, leases snapshots for its pods.
AGENT_RULES: tuple[Rule, ...] = (
    _rule([GROUP], ["nodecaches"], [*_READ, "create", "update", "patch"]),
    _rule([GROUP], ["nodecaches/status"], _STATUS),
    _rule([GROUP], ["modeldatacaches", "modelimagecaches", "revocations"], _READ),
    _rule([""], ["pods"], _READ),
    _rule([""], ["nodes"], ["get", "patch"]),  # patch: its own Node's revision labels
    _rule(["", "events.k8s.io"], ["events"], ["create", "patch"]),
)

#: The agent in its own namespace: the origin slot Leases (one per slot, claimed, renewed
#: and freed by update) and the peer settings ConfigMap (read only).
AGENT_PEER_RULES: tuple[Rule, ...] = (
    _rule(["coordination.k8s.io"], ["leases"], ["get", "list", "create", "update"]),
    _rule([""], ["configmaps"], ["get"]),
)

#: The operator in the system namespace: the cluster's peer settings (are peers on? then
#: engine pods pull from the agents first).
OPERATOR_SETTINGS_RULES: tuple[Rule, ...] = (_rule([""], ["configmaps"], ["get"]),)

#: The engine pods' init container (``snapshot-init --peers-from-nodecaches``): the agents'
#: peer URLs from their NodeCaches; cluster-scoped objects, so a ClusterRole.
ENGINE_RULES: tuple[Rule, ...] = (_rule([GROUP], ["nodecaches"], ["get", "list"]),)

#: The router: discovers the endpoint's pods and reads its routing spec; namespaced.
ROUTER_RULES: tuple[Rule, ...] = (
    _rule(["discovery.k8s.io"], ["endpointslices"], _READ),
    _rule([GROUP], ["inferenceendpoints"], _READ),
)


def _sa(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
    }


def _role(
    kind: str, name: str, rules: Iterable[Rule], labels: dict[str, str], namespace: str | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": meta,
        "rules": [dict(r) for r in rules],
    }


def _binding(
    kind: str, name: str, role_kind: str, sa: str, sa_namespace: str, labels: dict[str, str],
    namespace: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_namespace}],
    }
