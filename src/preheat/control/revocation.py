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
from every node as soon as no replica holds it. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses

from preheat.control.state import Desired, DesiredVariant, Observed, Revoked, revision_of

__all__ = ["Substitution", "substitute"]


@dataclasses.dataclass(frozen=True)
class Substitution:
    desired: Desired
    observed: Observed
    actions: tuple[Revoked, ...]
    #: Variants that may not start replicas this tick (revoked, no fallback).
    held: frozenset[str]


def _fallback(dv: DesiredVariant, revoked: frozenset[str]) -> tuple[str, int] | None:
    for rev, size in dv.fallbacks:
        if rev not in revoked and rev != dv.revision:
            return rev, size
    return None


def substitute(desired: Desired, observed: Observed) -> Substitution:
    """``desired`` and ``observed`` as the rest of the planner must see them."""
    revoked = observed.revoked
    if not revoked:
        return Substitution(desired, observed, (), frozenset())
    variants: list[DesiredVariant] = []
    actions: list[Revoked] = []
    held: set[str] = set()
    for dv in desired.variants:
        if dv.revision not in revoked:
            variants.append(dv)
            continue
        fb = _fallback(dv, revoked)
        if fb is None:
            actions.append(Revoked(dv.name, dv.revision, None))
            held.add(dv.name)
            variants.append(dv)
        else:
            actions.append(Revoked(dv.name, dv.revision, fb[0]))
            variants.append(dataclasses.replace(dv, revision=fb[0], model_bytes=fb[1]))
    statuses = tuple(
        (name, dataclasses.replace(st, stable=None))
        if st.stable is not None and revision_of(st.stable) in revoked
        else (name, st)
        for name, st in observed.variants
    )
    return Substitution(
        dataclasses.replace(desired, variants=tuple(variants)),
        dataclasses.replace(observed, variants=statuses),
        tuple(actions),
        frozenset(held),
    )
