"""The HorizontalPodAutoscaler for an endpoint variant with ``autoscaling`` (pure).

Local mode scales on the router's in-flight requests per replica
(``control.autoscale``); in a cluster the same signal drives an ``autoscaling/v2beta2``
HPA (served since 1.12, so on the 1.20 test cluster): an **External** metric
``preheat_router_in_flight`` for the variant, with an ``AverageValue`` target of
``autoscaling.targetInFlight`` (the HPA divides the metric by the pod count: in-flight
per replica, as local mode computes it), ``minReplicas``/``maxReplicas`` from the
spec's ``replicas`` and a scale-down stabilization window of ``cooldownSeconds``.
The metric's selector pins ``endpoint`` and ``variant``: the series ``preheat
metrics-adapter`` (``metrics_adapter.py``) serves, summed over the endpoint's routers'
``/metrics``; without an adapter the HPA reports ``ScalingActive=False`` and leaves the
count alone. The operator sets a Deployment's
count only on create for such an endpoint (``workload.replica_count``).
"""

from __future__ import annotations

import math
from typing import Any

from preheat.control.spec_types import EndpointSpec, VariantSpec

__all__ = ["IN_FLIGHT_METRIC", "hpa_body"]

IN_FLIGHT_METRIC = "preheat_router_in_flight"


def hpa_body(
    spec: EndpointSpec, variant: VariantSpec, *, deployment: str, namespace: str
) -> dict[str, Any] | None:
    """The HPA for ``variant``'s Deployment ``deployment``, or ``None`` when the spec has
    no ``autoscaling`` or its replica range cannot move (``min == max``)."""
    a = spec.autoscaling
    if a is None or variant.replicas.max <= variant.replicas.min:
        return None
    target = f"{math.ceil(a.target_in_flight * 1000)}m"
    return {
        "apiVersion": "autoscaling/v2beta2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": deployment,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "preheat",
                "app.kubernetes.io/component": "autoscaler",
                "preheat.dev/endpoint": spec.name,
                "preheat.dev/variant": variant.name,
            },
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "minReplicas": max(1, variant.replicas.min),
            "maxReplicas": variant.replicas.max,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": IN_FLIGHT_METRIC,
                            "selector": {
                                "matchLabels": {"endpoint": spec.name, "variant": variant.name}
                            },
                        },
                        "target": {"type": "AverageValue", "averageValue": target},
                    },
                }
            ],
            "behavior": {
                "scaleDown": {
                    "stabilizationWindowSeconds": math.ceil(a.cooldown_seconds),
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 15}],
                }
            },
        },
    }
