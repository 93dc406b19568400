"""The metrics adapter's manifests (part of ``preheat k8s render``'s system set).

* ``ServiceAccount`` ``preheat-metrics-adapter`` with the ClusterRole
  :data:`ADAPTER_RULES` (list EndpointSlices, to find each endpoint's routers; create
  SubjectAccessReviews, to authorize each request as the API server would), and a
  RoleBinding in ``kube-system`` to the built-in ``extension-apiserver-authentication-reader``
  Role (read the front-proxy CA the adapter authenticates the aggregator with). It does
  not bind ``system:auth-delegator``: that also grants ``tokenreviews``, and the adapter
  accepts no bearer tokens (only the aggregator's front-proxy certificate).
* The ClusterRole :data:`HPA_READER_RULES` bound to the HPA controller
  (``kube-system/horizontal-pod-autoscaler``): 1.20's bootstrap policy does not let it
  list external metrics (measured on the test cluster), so without this every HPA sync is refused
  (``FailedGetExternalMetric ... forbidden``); prometheus-adapter and KEDA ship the same
  binding. Only ``list`` on the metrics preheat serves.
* The ``Deployment`` (one replica; the adapter keeps no state, so more may run) serving
  HTTPS on 6443 with a certificate it generates for its Service's names, and its
  ``Service`` (443).
* The ``APIService`` ``v1beta1.external.metrics.k8s.io`` pointing at that Service. With
  no ``ca_bundle`` it sets ``insecureSkipTLSVerify`` (the generated certificate is new on
  every start, as with prometheus-adapter's default install); give the adapter a fixed
  certificate (``--tls-cert-file``/``--tls-private-key-file`` from a Secret) and its PEM as
  ``ca_bundle`` to have the aggregator verify it. One cluster has one provider of this
  APIService: if ``kubectl get apiservice v1beta1.external.metrics.k8s.io`` already shows
  another (KEDA, prometheus-adapter), do not apply this one.
"""

from __future__ import annotations

import base64
from typing import Any

from preheat.runtime.kubernetes.metrics_adapter_core import GROUP, METRICS, VERSION
from preheat.runtime.kubernetes.render import _container, _deployment, _labels, _service
from preheat.runtime.kubernetes.render_rbac import Rule, _binding, _role, _rule, _sa

__all__ = [
    "ADAPTER_NAME",
    "ADAPTER_PORT",
    "ADAPTER_RULES",
    "HPA_READER",
    "HPA_READER_RULES",
    "adapter_manifests",
    "api_service",
]

ADAPTER_NAME = "preheat-metrics-adapter"
ADAPTER_PORT = 6443

#: The metrics adapter: finds routers, authorizes requests; nothing else.
ADAPTER_RULES: tuple[Rule, ...] = (
    _rule(["discovery.k8s.io"], ["endpointslices"], ["list"]),
    _rule(["authorization.k8s.io"], ["subjectaccessreviews"], ["create"]),
)

#: The HPA controller: read the external metrics the rendered HPAs name.
HPA_READER_RULES: tuple[Rule, ...] = (_rule([GROUP], list(METRICS), ["list"]),)
HPA_READER = "preheat-hpa-external-metrics"
#: The controller-manager's HPA controller identity (``--use-service-account-credentials``).
HPA_CONTROLLER_SA = ("kube-system", "horizontal-pod-autoscaler")


def api_service(
    namespace: str, *, service: str = ADAPTER_NAME, port: int = 443, ca_bundle: bytes | None = None
) -> dict[str, Any]:
    """The ``APIService`` that sends ``external.metrics.k8s.io/v1beta1`` to ``service``."""
    spec: dict[str, Any] = {
        "group": GROUP,
        "version": VERSION,
        "groupPriorityMinimum": 100,
        "versionPriority": 100,
        "service": {"name": service, "namespace": namespace, "port": port},
    }
    if ca_bundle is None:
        spec["insecureSkipTLSVerify"] = True
    else:
        spec["caBundle"] = base64.b64encode(ca_bundle).decode()
    return {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": f"{VERSION}.{GROUP}", "labels": _labels("metrics-adapter")},
        "spec": spec,
    }


def adapter_manifests(
    *, namespace: str, image: str, ca_bundle: bytes | None = None
) -> list[dict[str, Any]]:
    """ServiceAccount, RBAC, Deployment, Service and APIService of the metrics adapter."""
    labels = _labels("metrics-adapter")
    names = [f"{ADAPTER_NAME}.{namespace}.svc", f"{ADAPTER_NAME}.{namespace}.svc.cluster.local"]
    args = ["metrics-adapter", "--host", "0.0.0.0", "--port", str(ADAPTER_PORT)]
    for n in names:
        args += ["--tls-san", n]
    deployment = _deployment(
        ADAPTER_NAME, namespace, labels,
        {
            "serviceAccountName": ADAPTER_NAME,
            "containers": [
                _container(
                    "adapter",
                    image,
                    args,
                    [("https", ADAPTER_PORT)],
                    readinessProbe={
                        "httpGet": {"path": "/healthz", "port": "https", "scheme": "HTTPS"},
                        "periodSeconds": 5,
                    },
                    resources={"requests": {"cpu": "50m", "memory": "128Mi"}},
                )
            ],
        },
    )  # fmt: skip
    service = _service(ADAPTER_NAME, namespace, labels, "https", 443)
    reader = _binding(
        "RoleBinding", f"{ADAPTER_NAME}-auth-reader", "Role", ADAPTER_NAME, namespace, labels,
        "kube-system",
    )  # fmt: skip
    reader["roleRef"]["name"] = "extension-apiserver-authentication-reader"
    hpa_ns, hpa_sa = HPA_CONTROLLER_SA
    return [
        _sa(ADAPTER_NAME, namespace, labels),
        _role("ClusterRole", ADAPTER_NAME, ADAPTER_RULES, labels, None),
        _binding(
            "ClusterRoleBinding", ADAPTER_NAME, "ClusterRole", ADAPTER_NAME, namespace, labels
        ),
        reader,
        _role("ClusterRole", HPA_READER, HPA_READER_RULES, labels, None),
        _binding("ClusterRoleBinding", HPA_READER, "ClusterRole", hpa_sa, hpa_ns, labels),
        deployment,
        service,
        api_service(namespace, ca_bundle=ca_bundle),
    ]
