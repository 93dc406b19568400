"""Who owns a variant's replica count (the spec, or an HPA / `kubectl scale`), and the
rendered HPA for `autoscaling`."""

from __future__ import annotations

from typing import Any

from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.autoscaler import IN_FLIGHT_METRIC, hpa_body
from preheat.runtime.kubernetes.render import endpoint_manifests
from preheat.runtime.kubernetes.workload import SPEC_REPLICAS_ANNOTATION, replica_count


def _dep(replicas: int, applied: int | None) -> dict[str, Any]:
    ann = {} if applied is None else {SPEC_REPLICAS_ANNOTATION: str(applied)}
    return {"metadata": {"annotations": ann}, "spec": {"replicas": replicas}}


def test_the_spec_count_applies_on_create() -> None:
    """Without a Deployment the spec's count is used, autoscaled or not."""
    assert replica_count(2, None, autoscaled=False) == 2
    assert replica_count(2, None, autoscaled=True) == 2


def test_a_count_someone_else_set_is_kept_while_the_spec_count_is_unchanged() -> None:
    """The Deployment scaled to 5 (HPA, kubectl scale) with the spec still at 2: keep 5."""
    assert replica_count(2, _dep(5, applied=2), autoscaled=False) == 5


def test_a_changed_spec_count_is_applied() -> None:
    """The spec moved from 2 to 3: the spec's count wins once."""
    assert replica_count(3, _dep(5, applied=2), autoscaled=False) == 3


def test_a_deployment_without_the_annotation_gets_the_spec_count() -> None:
    """A Deployment from an older operator (no annotation) converges to the spec."""
    assert replica_count(2, _dep(7, applied=None), autoscaled=False) == 2


def test_with_autoscaling_only_the_create_sets_the_count() -> None:
    """`autoscaling` in the spec: the HPA owns the count, even when the spec's min moves."""
    assert replica_count(3, _dep(6, applied=2), autoscaled=True) == 6


def test_render_emits_an_hpa_on_the_router_in_flight_metric_for_autoscaling() -> None:
    """`autoscaling` + a movable replica range: one HPA per variant Deployment, min/max
    from the spec, in-flight per replica as the target, cooldown as scale-down window."""
    doc = {
        "name": "chat",
        "model": {"source": "http://127.0.0.1:1/m/preheat-manifest.json"},
        "replicas": {"min": 2, "max": 6},
        "autoscaling": {"target_in_flight": 4, "scale_in_below": 1, "cooldown_seconds": 30},
    }
    hpas = [
        o
        for o in endpoint_manifests(parse_endpoint(doc, origin="t"), namespace="ml")
        if o["kind"] == "HorizontalPodAutoscaler"
    ]
    assert len(hpas) == 1
    spec = hpas[0]["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": "chat-main"}  # fmt: skip
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    metric = spec["metrics"][0]["external"]
    assert metric["metric"]["name"] == IN_FLIGHT_METRIC
    assert metric["target"] == {"type": "AverageValue", "averageValue": "4000m"}
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 30


def test_no_hpa_without_autoscaling_or_with_a_fixed_replica_count() -> None:
    """Nothing to scale: no HPA object."""
    fixed = parse_endpoint(
        {"name": "chat", "model": {"source": "http://127.0.0.1:1/m"}, "replicas": {"min": 2,
         "max": 2}, "autoscaling": {"target_in_flight": 4, "scale_in_below": 1}},
        origin="t",
    )  # fmt: skip
    plain = parse_endpoint(
        {"name": "chat", "model": {"source": "http://127.0.0.1:1/m"}}, origin="t"
    )
    for spec in (fixed, plain):
        assert hpa_body(spec, spec.variants[0], deployment="chat-main", namespace="ml") is None
