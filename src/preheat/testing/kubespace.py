"""One test module's share of a session-wide test cluster, and its clean-up.

Booting a control plane costs about 6 s on an idle machine and 60-90 s at load 20, so
the Kubernetes test modules share one :class:`~preheat.testing.kube.KubeCluster` per
pytest session (``kube_session`` in ``tests/integration/conftest.py``). :func:`kube_share`
makes that safe whatever the order of the modules:

* the module names its own namespace(s) and nodes (names no other module uses; creating
  a namespace that exists is an error), created when the share opens;
* when the share closes, everything the module made is removed: :func:`snapshot` lists
  the cluster-wide objects of :data:`TRACKED` kinds when the share opens, and
  :func:`release` deletes every one that is new when it closes (APIServices first, so
  namespace deletion's discovery stays healthy; then the new namespaces, with the
  finalizers of preheat's custom objects in them stripped, since the operator that would
  finish them has stopped, and their pods deleted at once (grace 0; the module's
  stand-ins still run and end the processes), waited for until gone; then its stand-ins, Nodes and their Leases; then the rest:
  ClusterRoles and bindings, Roles and RoleBindings in namespaces that stay, NodeCaches,
  Revocations, CRDs).

So the next module finds the cluster as the session started it: CRDs installed, no nodes,
no namespaces but the built-in ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from preheat.runtime.kubernetes.crds import custom_resource_definitions
from preheat.testing.kube import KubeCluster
from preheat.testing.kubewait import until

__all__ = ["TRACKED", "Kind", "kube_share", "release", "snapshot"]

_MERGE = "application/merge-patch+json"
#: Namespaces the API server makes; never deleted.
_BUILTIN_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})


@dataclass(frozen=True)
class Kind:
    """A kind whose objects a module may create: its API prefix, plural, and scope."""

    prefix: str
    plural: str
    namespaced: bool

    def list_path(self) -> str:
        return f"{self.prefix}/{self.plural}"

    def path(self, namespace: str | None, name: str) -> str:
        if self.namespaced:
            return f"{self.prefix}/namespaces/{namespace}/{self.plural}/{name}"
        return f"{self.prefix}/{self.plural}/{name}"


_RBAC = "/apis/rbac.authorization.k8s.io/v1"
_PREHEAT = "/apis/preheat.dev/v1alpha1"
APISERVICES = Kind("/apis/apiregistration.k8s.io/v1", "apiservices", False)
NAMESPACES = Kind("/api/v1", "namespaces", False)
NODES = Kind("/api/v1", "nodes", False)
#: Deleted in this order (after APIServices, namespaces and nodes). Namespaced kinds are
#: listed across all namespaces: what a module adds to kube-system (the metrics adapter's
#: RoleBinding) or kube-node-lease (a node's Lease) is its own too.
TRACKED: tuple[Kind, ...] = (
    APISERVICES,
    NAMESPACES,
    NODES,
    Kind("/apis/coordination.k8s.io/v1", "leases", True),
    Kind(_RBAC, "roles", True),
    Kind(_RBAC, "rolebindings", True),
    Kind(_RBAC, "clusterroles", False),
    Kind(_RBAC, "clusterrolebindings", False),
    Kind(_PREHEAT, "nodecaches", False),
    Kind(_PREHEAT, "revocations", False),
    Kind("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
)

#: (kind, namespace or None, name)
Key = tuple[Kind, str | None, str]


def snapshot(cluster: KubeCluster) -> set[Key]:
    """Every object of the :data:`TRACKED` kinds on the cluster now."""
    admin = cluster.rest()
    out: set[Key] = set()
    for kind in TRACKED:
        status, body = admin.call("GET", kind.list_path())
        if status == 404:  # e.g. preheat's CRDs not installed on this cluster
            continue
        if status != 200:
            raise RuntimeError(f"GET {kind.list_path()} answered {status}: {body}")
        for item in body.get("items") or ():
            meta = item["metadata"]
            out.add((kind, meta.get("namespace"), meta["name"]))
    return out


def _namespaced_custom_kinds() -> list[Kind]:
    out = []
    for crd in custom_resource_definitions():
        spec = crd["spec"]
        if spec["scope"] == "Namespaced":
            version = spec["versions"][0]["name"]
            out.append(Kind(f"/apis/{spec['group']}/{version}", spec["names"]["plural"], True))
    return out


def _delete(cluster: KubeCluster, path: str, *, strip_finalizers: bool = False) -> None:
    admin = cluster.rest()
    if strip_finalizers:
        admin.call("PATCH", path, {"metadata": {"finalizers": None}}, content_type=_MERGE)
    status, body = admin.call("DELETE", path)
    if status not in (200, 202, 404, 409):
        raise RuntimeError(f"DELETE {path} answered {status}: {body}")


def _strip_custom_finalizers(cluster: KubeCluster, namespace: str) -> None:
    """Let preheat's custom objects in ``namespace`` go although the operator (whose
    finalizers they carry) has already stopped."""
    admin = cluster.rest()
    for kind in _namespaced_custom_kinds():
        status, body = admin.call("GET", f"{kind.prefix}/namespaces/{namespace}/{kind.plural}")
        if status != 200:
            continue
        for item in body.get("items") or ():
            if item["metadata"].get("finalizers"):
                path = kind.path(namespace, item["metadata"]["name"])
                patch = {"metadata": {"finalizers": None}}
                admin.call("PATCH", path, patch, content_type=_MERGE)


def _force_pods(cluster: KubeCluster, namespace: str) -> None:
    """Delete the pods left in ``namespace`` at once (grace 0): pods on a node whose
    stand-in a test stopped would otherwise wait for a kubelet forever."""
    admin = cluster.rest()
    status, body = admin.call("GET", f"/api/v1/namespaces/{namespace}/pods")
    if status != 200:
        return
    options = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
    for pod in body.get("items") or ():
        name = pod["metadata"]["name"]
        admin.call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", options)


def _delete_namespaces(cluster: KubeCluster, names: Sequence[str], timeout: float) -> None:
    admin = cluster.rest()
    for ns in names:
        _strip_custom_finalizers(cluster, ns)
        # Pods first, at once: the stand-ins end their processes without a grace period,
        # so the namespace controller does not wait out each pod's graceful termination.
        _force_pods(cluster, ns)
        _delete(cluster, NAMESPACES.path(None, ns))

    def gone() -> bool:
        left = [ns for ns in names if admin.call("GET", NAMESPACES.path(None, ns))[0] != 404]
        for ns in left:
            # Objects the operator made while the namespace was terminating, and pods a
            # ReplicaSet made before the namespace controller reached it: those the
            # namespace controller deletes with their grace period, and on a Node with no
            # kubelet (a module's bare Node objects) nothing would ever finish them.
            _strip_custom_finalizers(cluster, ns)
            _force_pods(cluster, ns)
        return not left

    # the module's stand-ins still run and end their pods' processes
    until(f"namespaces {', '.join(names)} deleted", gone, timeout)


def release(
    cluster: KubeCluster, before: set[Key], stand_ins: set[str], *, timeout: float = 120.0
) -> None:
    """Delete everything of the :data:`TRACKED` kinds that is not in ``before``, and stop
    the stand-ins not in ``stand_ins`` (see the module docstring for the order)."""
    new = snapshot(cluster) - before
    for kind, ns, name in sorted((k for k in new if k[0] is APISERVICES), key=lambda k: k[2]):
        _delete(cluster, kind.path(ns, name))
    doomed = sorted(n for k, _, n in new if k is NAMESPACES and n not in _BUILTIN_NAMESPACES)
    _delete_namespaces(cluster, doomed, timeout)
    nodes = {n for k, _, n in new if k is NODES} | (set(cluster.kubelets) - stand_ins)
    for name in sorted(nodes):
        cluster.remove_node(name)
    for kind in TRACKED[3:]:
        for _, ns, name in sorted((k for k in new if k[0] is kind), key=lambda k: k[1:]):
            if ns in doomed:
                continue  # went with its namespace
            _delete(cluster, kind.path(ns, name), strip_finalizers=kind.prefix == _PREHEAT)


@contextlib.contextmanager
def kube_share(
    cluster: KubeCluster,
    *,
    namespaces: Sequence[str] = (),
    nodes: Mapping[str, Mapping[str, str]] | None = None,
    **node_kw: Any,
) -> Iterator[KubeCluster]:
    """Open a module's share of ``cluster``: create its ``namespaces`` and ``nodes``
    (name -> labels, each run by a stand-in; ``node_kw`` goes to ``add_node``), yield the
    cluster, and on the way out remove everything the module made (:func:`release`)."""
    before = snapshot(cluster)
    stand_ins = set(cluster.kubelets)
    try:
        for ns in namespaces:
            cluster.create_namespace(ns)
        for name, labels in (nodes or {}).items():
            cluster.add_node(name, labels=labels, **node_kw)
        yield cluster
    finally:
        release(cluster, before, stand_ins)
