"""Revocation in the planner: a revoked revision is replaced by an allowed fallback.

The cluster-wide revocation list (local mode: the fleet's list applied to every node's
store; Kubernetes: ``Revocation`` objects the agents and the operator watch) reaches the
planner as ``Observed.revoked``, the set of revoked revisions. Before anything else in a
tick (``plan.py``), each variant whose resolved revision is on it is rewritten:

* it has a fallback (``DesiredVariant.fallbacks``, the spec's ``model.fallback`` list,
  resolved) that is not revoked: the variant's revision *becomes* the first such
  fallback for this tick, so the ordinary steps warm it, gate it and roll the replicas
  to it (surge first, as any rollout); ``Revoked(variant, revision, to=fallback)``;
* it has none: the revision stays (its replicas keep serving: taking a model away from
  users is the operator's call, not ours), no new replica of it may start (a pull would
  be refused anyway), and ``Revoked(variant, revision, to=None)`` marks it Degraded.

A revoked *stable* version is no rollback target (``stable`` is cleared for the tick),
no revoked revision is warmed, and none is kept for rollback: ``plan.py`` deletes it
from every node as soon as no replica holds it.

Images the same way: a variant whose image digest (``DesiredVariant.image``: the
digests its tag resolved to in the image cache) is revoked runs the template of its
first ``image.fallback`` whose digests are not revoked (``Revoked(kind="image")``;
the new template is a new version, so the surge rollout moves the replicas), or, with
none, is held and reported exactly like a revoked revision. A stable version whose
template runs a revoked image is no rollback target. Both can apply to one variant in
one tick (a revoked revision *and* a revoked image): each is substituted or held on its
own.

A revoked *layer* (a tar or raw layer digest of an ``oci://`` revision: a vulnerable
tokenizer file, a withdrawn weight shard) revokes every revision built from it:
``revoked_by_layers`` names them, from what the adapter knows of each revision's layers
(the operator: the revision's OCI manifest; the local fleet: the stores' records of what
was unpacked from which layer), and they join ``Observed.revoked``, so a variant on one
rolls to its fallback or is held exactly as above, a fallback built from the layer is
skipped, and no rollback goes to a stable version built from it. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping

from preheat.control.state import (
    Desired,
    DesiredVariant,
    Observed,
    Revoked,
    revision_of,
    template_of,
)

__all__ = ["Substitution", "revoked_by_layers", "substitute"]


@dataclasses.dataclass(frozen=True)
class Substitution:
    desired: Desired
    observed: Observed
    actions: tuple[Revoked, ...]
    #: Variants that may not start replicas this tick (revoked, no fallback).
    held: frozenset[str]
    #: Templates that run a revoked image: no rollback goes to a version with one.
    revoked_templates: frozenset[str] = frozenset()


def revoked_by_layers(keys: Collection[str], layers: Mapping[str, Iterable[str]]) -> frozenset[str]:
    """The revisions of ``layers`` (revision -> digests of the layers it is built from)
    that have a layer among the revoked ``keys``: each counts as revoked itself."""
    if not keys:
        return frozenset()
    return frozenset(rev for rev, ds in layers.items() if any(d in keys for d in ds))


def _fallback(dv: DesiredVariant, revoked: frozenset[str]) -> tuple[str, int] | None:
    for rev, size in dv.fallbacks:
        if rev not in revoked and rev != dv.revision:
            return rev, size
    return None


def _image_fallback(dv: DesiredVariant, revoked: frozenset[str]) -> tuple[str, str] | None:
    """``(digest, template)`` of the first ``image.fallback`` that is not revoked."""
    for digests, template in dv.image_fallbacks:
        if digests and not revoked.intersection(digests) and template != dv.template:
            return digests[0], template
    return None


def _substitute_one(
    dv: DesiredVariant, revoked: frozenset[str], actions: list[Revoked], held: set[str]
) -> DesiredVariant:
    """``dv`` with its revoked revision and its revoked image replaced (or held)."""
    if dv.revision in revoked:
        fb = _fallback(dv, revoked)
        if fb is None:
            actions.append(Revoked(dv.name, dv.revision, None))
            held.add(dv.name)
        else:
            actions.append(Revoked(dv.name, dv.revision, fb[0]))
            dv = dataclasses.replace(dv, revision=fb[0], model_bytes=fb[1])
    hit = sorted(revoked.intersection(dv.image))
    if hit:
        ifb = _image_fallback(dv, revoked)
        if ifb is None:
            actions.append(Revoked(dv.name, hit[0], None, kind="image"))
            held.add(dv.name)
        else:
            actions.append(Revoked(dv.name, hit[0], ifb[0], kind="image"))
            dv = dataclasses.replace(dv, template=ifb[1], image=())
    return dv


def substitute(desired: Desired, observed: Observed) -> Substitution:
    """``desired`` and ``observed`` as the rest of the planner must see them."""
    revoked = observed.revoked
    if not revoked:
        return Substitution(desired, observed, (), frozenset())
    variants: list[DesiredVariant] = []
    actions: list[Revoked] = []
    held: set[str] = set()
    # Templates that run a revoked image: a stable version with one is no rollback target.
    bad_templates = {dv.template for dv in desired.variants if revoked.intersection(dv.image)}
    for dv in desired.variants:
        variants.append(_substitute_one(dv, revoked, actions, held))
    statuses = tuple(
        (name, dataclasses.replace(st, stable=None))
        if st.stable is not None
        and (revision_of(st.stable) in revoked or template_of(st.stable) in bad_templates)
        else (name, st)
        for name, st in observed.variants
    )
    return Substitution(
        dataclasses.replace(desired, variants=tuple(variants)),
        dataclasses.replace(observed, variants=statuses),
        tuple(actions),
        frozenset(held),
        frozenset(bad_templates),
    )
