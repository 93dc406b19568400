"""The planner with a revoked image digest: roll to the image fallback, or hold and report."""

from __future__ import annotations

import dataclasses

from preheat.control.plan import plan
from preheat.control.state import (
    CacheView,
    Desired,
    DesiredVariant,
    Drain,
    NodeView,
    Observed,
    ReplicaView,
    Revoked,
    Rollback,
    StartReplica,
    StopReplica,
    VariantStatus,
    WeightsPolicy,
    version_of,
)

R1 = "sha256-1111111111111111"
R2 = "sha256-2222222222222222"
IMG = "sha256:" + "a" * 64
IDX = "sha256:" + "b" * 64
FB1 = "sha256:" + "c" * 64
FB2 = "sha256:" + "d" * 64
TPL, TPL1, TPL2 = "tplmain", "tplfb1", "tplfb2"


def desired(*fallbacks: tuple[str, str], model_fallback: bool = False) -> Desired:
    return Desired(
        endpoint="chat",
        variants=(
            DesiredVariant(
                "main",
                R1,
                1000,
                2,
                template=TPL,
                fallbacks=((R2, 900),) if model_fallback else (),
                image=(IMG, IDX),
                image_fallbacks=tuple(((d,), t) for d, t in fallbacks),
            ),
        ),
        weights=WeightsPolicy(enabled=True, timeout_seconds=60),
    )


def serving(*nodes: str, template: str = TPL) -> tuple[ReplicaView, ...]:
    return tuple(
        ReplicaView(f"r{i}", "main", R1, n, "ready", routed=True, seq=i, template=template)
        for i, n in enumerate(nodes)
    )


def steady(revoked: frozenset[str]) -> Observed:
    ready = (R1, CacheView("ready")), (R2, CacheView("ready"))
    return Observed(
        now=10,
        nodes=(NodeView("a", slots=3, cache=ready), NodeView("b", slots=3, cache=ready)),
        replicas=serving("a", "b"),
        variants=(
            ("main", VariantStatus(stable=version_of(R1, TPL), gate_open=frozenset({R1, R2}))),
        ),
        revoked=revoked,
    )


def of(actions: tuple[object, ...], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def test_revoked_image_rolls_to_first_allowed_image_fallback() -> None:
    """A revoked image digest (the index one counts too) moves the variant to the template
    of the first image fallback that is not revoked: new replicas surge in with it."""
    acts = plan(desired((FB1, TPL1), (FB2, TPL2)), steady(frozenset({IDX, FB1})))
    (r,) = of(acts, Revoked)
    assert (r.variant, r.revision, r.to, r.kind) == ("main", IDX, FB2, "image")
    assert "image" in r.message and "rolling to fallback" in r.message
    starts = of(acts, StartReplica)
    assert starts and {s.template for s in starts} == {TPL2}
    assert {s.revision for s in starts} == {R1}  # the weights stay what they were


def test_revoked_image_without_fallback_holds_and_reports() -> None:
    """No allowed image fallback: reported (naming image.fallback), serving replicas keep
    running, and no replica starts, not even to replace a lost one."""
    obs = dataclasses.replace(steady(frozenset({IMG})), replicas=serving("a"))
    acts = plan(desired((FB1, TPL1)), dataclasses.replace(obs, revoked=frozenset({IMG, FB1})))
    (r,) = of(acts, Revoked)
    assert r.to is None and r.kind == "image" and "image.fallback" in r.message
    assert of(acts, StartReplica) == []
    assert of(acts, StopReplica) == [] and of(acts, Drain) == []


def test_unrevoked_image_plans_as_before() -> None:
    """With the image digest off the list, the image fallbacks change nothing."""
    obs = steady(frozenset({R2}))
    assert plan(desired((FB1, TPL1)), obs) == plan(desired(), obs)
    assert of(plan(desired((FB1, TPL1)), obs), Revoked) == []


def test_revoked_revision_and_image_are_both_substituted() -> None:
    """A variant whose revision and image are both revoked rolls to the model fallback
    with the image fallback's template, one Revoked per cause."""
    acts = plan(desired((FB1, TPL1), model_fallback=True), steady(frozenset({R1, IMG})))
    kinds = sorted((r.kind, r.to) for r in of(acts, Revoked))
    assert kinds == [("image", FB1), ("revision", R2)]
    starts = of(acts, StartReplica)
    assert starts and {(s.revision, s.template) for s in starts} == {(R2, TPL1)}


def test_stable_version_with_revoked_image_is_no_rollback_target() -> None:
    """A failed rollout from a stable version whose image is revoked does not roll back."""
    obs = dataclasses.replace(
        steady(frozenset({IMG})),
        replicas=(
            *serving("a"),
            ReplicaView("n1", "main", R1, "b", "failed", seq=5, template=TPL1),
        ),
    )
    d = desired((FB1, TPL1))
    assert of(plan(d, obs), Rollback) == []
    assert of(plan(d, dataclasses.replace(obs, revoked=frozenset())), Rollback) == []
    moved = dataclasses.replace(d, variants=(dataclasses.replace(d.variants[0], template=TPL1),))
    assert of(plan(moved, dataclasses.replace(obs, revoked=frozenset())), Rollback) != []
