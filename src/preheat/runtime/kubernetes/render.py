"""Every manifest of Kubernetes mode, rendered from Python (``preheat k8s render``).

Three sets:

* **CRDs** (:mod:`preheat.runtime.kubernetes.crds`).
* **System** (namespace ``preheat-system`` by default): the operator's and the agent's
  ServiceAccounts, least-privilege ClusterRoles and bindings, the operator Deployment and
  the node agent DaemonSet (hostPath store at ``/var/lib/preheat/store``).
* **Per endpoint** (the endpoint's namespace): the router's ServiceAccount, Role and
  RoleBinding (read EndpointSlices and InferenceEndpoints, nothing else), the router
  Deployment and Service, and the ``InferenceEndpoint`` itself.

Least privilege is written here, next to the verbs each component calls
(:data:`OPERATOR_RULES`, :data:`AGENT_RULES`, :data:`ROUTER_RULES`); the tests apply these
Roles to ServiceAccounts on the real API server and check both what is allowed and a 403
for a verb outside them. RBAC cannot scope a DaemonSet pod to "its own" NodeCache by name,
so every agent may write every NodeCache; each agent writes only its own by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from preheat.control.spec import EndpointSpec
from preheat.runtime.kubernetes.autoscaler import hpa_body
from preheat.runtime.kubernetes.crds import GROUP, custom_resource_definitions
from preheat.runtime.kubernetes.discovery import variant_service_name
from preheat.runtime.kubernetes.resources import PodOverrides, endpoint_object

__all__ = [
    "AGENT_RULES",
    "DEFAULT_IMAGE",
    "OPERATOR_RULES",
    "ROUTER_RULES",
    "STORE_HOST_PATH",
    "SYSTEM_NAMESPACE",
    "dump_all",
    "endpoint_manifests",
    "render",
    "system_manifests",
]

SYSTEM_NAMESPACE = "preheat-system"
DEFAULT_IMAGE = "preheat:0.1.0"
STORE_HOST_PATH = "/var/lib/preheat/store"
OPERATOR_METRICS_PORT = 9100
AGENT_PORT = 9101
#: The node image mirror the agent serves on each node's 127.0.0.1 (``--mirror-port``); the
#: default of ``preheat k8s render --mirror-url`` (containerd's ``hosts.toml``) points at it.
MIRROR_PORT = 5001
ROUTER_PORT = 8080

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
    _rule([GROUP], ["modeldatacaches/status", "modelimagecaches/status"], _STATUS),
    _rule([GROUP], ["nodecaches"], _READ),
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
    _rule([GROUP], ["modeldatacaches", "modelimagecaches"], _READ),
    _rule([""], ["pods"], _READ),
    _rule([""], ["nodes"], ["get", "patch"]),  # patch: its own Node's revision labels
    _rule(["", "events.k8s.io"], ["events"], ["create", "patch"]),
)

#: The router: discovers the endpoint's pods and reads its routing spec; namespaced.
ROUTER_RULES: tuple[Rule, ...] = (
    _rule(["discovery.k8s.io"], ["endpointslices"], _READ),
    _rule([GROUP], ["inferenceendpoints"], _READ),
)


def _labels(component: str, instance: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": f"preheat-{component}", "app.kubernetes.io/part-of": "preheat"}
    if instance:
        out["app.kubernetes.io/instance"] = instance
    return out


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


def _container(
    name: str, image: str, args: list[str], ports: list[tuple[str, int]], **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": ["preheat"],
        "args": args,
        "ports": [{"name": n, "containerPort": p} for n, p in ports],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    out.update(extra)
    return out


def system_manifests(
    *, namespace: str = SYSTEM_NAMESPACE, image: str = DEFAULT_IMAGE
) -> list[dict[str, Any]]:
    """Namespace, operator and agent (RBAC, Deployment, DaemonSet)."""
    op, ag = _labels("operator"), _labels("agent")
    operator = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "preheat-operator", "namespace": namespace, "labels": op},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # one operator at a time (kopf --standalone)
            "selector": {"matchLabels": op},
            "template": {
                "metadata": {"labels": op},
                "spec": {
                    "serviceAccountName": "preheat-operator",
                    "containers": [
                        _container(
                            "operator",
                            image,
                            ["operator", "--metrics-port", str(OPERATOR_METRICS_PORT)],
                            [("metrics", OPERATOR_METRICS_PORT)],
                            resources={"requests": {"cpu": "100m", "memory": "256Mi"}},
                        )
                    ],
                },
            },
        },
    }
    agent = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "preheat-agent", "namespace": namespace, "labels": ag},
        "spec": {
            "selector": {"matchLabels": ag},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": ag},
                "spec": {
                    "serviceAccountName": "preheat-agent",
                    # The node's containerd (a host process) pulls through the mirror at
                    # 127.0.0.1:MIRROR_PORT: only the host network reaches that loopback
                    # (a hostPort is DNATed to the pod IP and not served on 127.0.0.1 by
                    # most CNIs), and the mirror binds loopback only, so it is not exposed.
                    "hostNetwork": True,
                    "dnsPolicy": "ClusterFirstWithHostNet",
                    # Every node that may run replicas needs its agent, GPU taints included.
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [
                        _container(
                            "agent",
                            image,
                            [
                                "agent",
                                "--node",
                                "$(NODE_NAME)",
                                "--store",
                                STORE_HOST_PATH,
                                "--port",
                                str(AGENT_PORT),
                                "--mirror-port",
                                str(MIRROR_PORT),
                            ],
                            [("http", AGENT_PORT), ("mirror", MIRROR_PORT)],
                            env=[
                                {
                                    "name": "NODE_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                }
                            ],
                            volumeMounts=[{"name": "store", "mountPath": STORE_HOST_PATH}],
                            resources={"requests": {"cpu": "100m", "memory": "256Mi"}},
                        )
                    ],
                    "volumes": [
                        {
                            "name": "store",
                            "hostPath": {"path": STORE_HOST_PATH, "type": "DirectoryOrCreate"},
                        }
                    ],
                },
            },
        },
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": {"app.kubernetes.io/part-of": "preheat"}},
        },
        _sa("preheat-operator", namespace, op),
        _role("ClusterRole", "preheat-operator", OPERATOR_RULES, op, None),
        _binding(
            "ClusterRoleBinding",
            "preheat-operator",
            "ClusterRole",
            "preheat-operator",
            namespace,
            op,
        ),
        _sa("preheat-agent", namespace, ag),
        _role("ClusterRole", "preheat-agent", AGENT_RULES, ag, None),
        _binding(
            "ClusterRoleBinding", "preheat-agent", "ClusterRole", "preheat-agent", namespace, ag
        ),
        operator,
        agent,
    ]


def endpoint_manifests(
    spec: EndpointSpec,
    *,
    namespace: str = "default",
    image: str = DEFAULT_IMAGE,
    pod: PodOverrides | None = None,
) -> list[dict[str, Any]]:
    """The router (RBAC, Deployment, Service) for one endpoint, the endpoint object, and
    with ``autoscaling`` an HPA per variant Deployment (``autoscaler.py``)."""
    name = f"preheat-router-{spec.name}"
    labels = _labels("router", spec.name)
    router = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": name,
                    "containers": [
                        _container(
                            "router",
                            image,
                            [
                                "router",
                                "serve",
                                "--kubernetes",
                                "--endpoint",
                                spec.name,
                                "--host",
                                "0.0.0.0",
                                "--port",
                                str(ROUTER_PORT),
                            ],
                            [("http", ROUTER_PORT)],
                            readinessProbe={
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 2,
                            },
                            resources={"requests": {"cpu": "250m", "memory": "256Mi"}},
                        )
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "selector": labels,
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }
    return [
        _sa(name, namespace, labels),
        _role("Role", name, ROUTER_RULES, labels, namespace),
        _binding("RoleBinding", name, "Role", name, namespace, labels, namespace),
        router,
        service,
        endpoint_object(spec, namespace=namespace, pod=pod),
        *(
            hpa
            for v in spec.variants
            if (
                hpa := hpa_body(
                    spec,
                    v,
                    deployment=variant_service_name(spec.name, v.name),
                    namespace=namespace,
                )
            )
            is not None
        ),
    ]


def render(
    endpoints: Sequence[tuple[EndpointSpec, PodOverrides]] = (),
    *,
    crds: bool = True,
    system: bool = True,
    namespace: str = "default",
    system_namespace: str = SYSTEM_NAMESPACE,
    image: str = DEFAULT_IMAGE,
) -> list[dict[str, Any]]:
    """All requested manifests, in apply order (CRDs, system, endpoints)."""
    out: list[dict[str, Any]] = []
    if crds:
        out += custom_resource_definitions()
    if system:
        out += system_manifests(namespace=system_namespace, image=image)
    for spec, pod in endpoints:
        out += endpoint_manifests(spec, namespace=namespace, image=image, pod=pod)
    return out


class _Dumper(yaml.SafeDumper):
    """Writes shared dicts (the same labels in metadata and selector) out in full."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_all(objects: Iterable[dict[str, Any]]) -> str:
    """A multi-document YAML stream (``kubectl apply -f -`` reads it), without anchors."""
    return yaml.dump_all(list(objects), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
