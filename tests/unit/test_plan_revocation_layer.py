"""The planner with a revoked layer: the revisions built from it roll or are held."""

from __future__ import annotations

from preheat.control.plan import plan
from preheat.control.revocation import revoked_by_layers
from preheat.control.state import (
    CacheView,
    Desired,
    DesiredVariant,
    NodeView,
    Observed,
    ReplicaView,
    Revoked,
    Rollback,
    StartReplica,
    VariantStatus,
    Warm,
    WeightsPolicy,
)

R1 = "sha256:1111111111111111"
R2 = "sha256:2222222222222222"
R3 = "sha256:3333333333333333"
BASE = "sha256:aaaaaaaaaaaaaaaa"  # the shared base layer (a tokenizer, say)
LAYERS = {R1: (BASE, "sha256:b1"), R2: (BASE, "sha256:b2"), R3: ("sha256:c3",)}


def desired(*fallbacks: str) -> Desired:
    fbs = tuple((f, 900) for f in fallbacks)
    return Desired(
        endpoint="chat",
        variants=(DesiredVariant("main", R1, 1000, 2, fallbacks=fbs),),
        weights=WeightsPolicy(enabled=True, timeout_seconds=60),
    )


def observed(keys: frozenset[str], stable: str = R1) -> Observed:
    nodes = tuple(NodeView(n, slots=2, cache=((R1, CacheView("ready")),)) for n in "ab")
    return Observed(
        now=10,
        nodes=nodes,
        replicas=tuple(
            ReplicaView(f"r{i}", "main", R1, n, "ready", routed=True, seq=i)
            for i, n in enumerate("ab")
        ),
        variants=(("main", VariantStatus(stable=stable, gate_open=frozenset({R1}))),),
        revoked=keys | revoked_by_layers(keys, LAYERS),
    )


def of(actions: tuple[object, ...], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def test_revoked_by_layers_names_every_revision_built_from_the_layer() -> None:
    """A layer shared by two revisions revokes both; a layer nobody uses revokes none."""
    assert revoked_by_layers(frozenset({BASE}), LAYERS) == {R1, R2}
    assert revoked_by_layers(frozenset({"sha256:c3"}), LAYERS) == {R3}
    assert revoked_by_layers(frozenset({"sha256:none"}), LAYERS) == frozenset()
    assert revoked_by_layers(frozenset(), LAYERS) == frozenset()


def test_a_revoked_layer_rolls_the_variant_past_fallbacks_built_from_it() -> None:
    """R1 and the first fallback R2 share the revoked base layer: the variant rolls to R3
    (warmed, never R2), with the revision named in the Revoked action."""
    acts = plan(desired(R2, R3), observed(frozenset({BASE})))
    (r,) = of(acts, Revoked)
    assert (r.variant, r.revision, r.to) == ("main", R1, R3)
    assert {w.revision for w in of(acts, Warm)} == {R3}


def test_a_revoked_layer_with_no_clean_fallback_holds_the_variant() -> None:
    """Every allowed version is built from the layer: the replicas keep serving, none
    starts, no rollback to the stable R1 (built from it too), and the variant is
    reported revoked with no target."""
    acts = plan(desired(R2), observed(frozenset({BASE})))
    (r,) = of(acts, Revoked)
    assert (r.revision, r.to) == (R1, None)
    assert of(acts, StartReplica) == [] and of(acts, Rollback) == []
    assert of(acts, Warm) == []


def test_an_unrelated_layer_changes_nothing() -> None:
    """A revoked layer no allowed revision is built from plans as with no revocation."""
    assert plan(desired(R2), observed(frozenset({"sha256:c3"}))) == plan(
        desired(R2), observed(frozenset())
    )
