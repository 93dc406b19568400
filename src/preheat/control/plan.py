"""The pure reconcile step: desired spec + observed state -> actions.

Order of concerns in one tick (the returned actions keep this order, and the executor
runs them in it):

0. **Revocations.** A variant whose revision is revoked runs its first allowed fallback
   instead, or is held (no new replicas) and reported (``revocation.py``); no revoked
   revision is warmed, kept for rollback, or rolled back to. A revoked image digest
   moves the variant to its image fallback's template the same way.
1. **Lost nodes.** Replicas on a node that is down are stopped (their router entries go
   with them); the steps below then see fewer replicas and replace them elsewhere.
2. **Rollback.** A new revision whose replica failed for good while a stable revision
   exists is marked failed (``rollout.py``).
3. **Warm.** When ``modelCacheConfig.weights`` is enabled, every up *target* node gets a
   ``Warm`` for each variant's effective revision it does not hold yet; a failed warm-up
   (origin unreachable) is retried once its ``retry_at`` has passed; a node that cannot
   hold the model (``unfit``) is left out and reported, and re-evaluated (warmed again)
   once its ``retry_at`` has passed when the reporter set one (space freed on the node;
   ``0``: nothing changed). With an origin ``budget`` the warm-ups are staggered by
   ``control.fanout.plan_fanout``: at most ``concurrent_fills`` from the origin at once
   (default one per revision), the rest wait for a node to hold the revision and then
   warm from it.
4. **Gate.** Replicas of a revision are not created until ``minReady`` target nodes hold
   it (default: every target node that can hold it: not ``unfit`` for good, and not
   short of room while a replica of another revision of the variant runs there: the
   rollout the gate would hold up is what frees that node). The gate opens once per revision
   and stays open (a later node loss does not stop scaling). After
   ``timeoutSeconds`` of waiting it opens anyway, and says so.
5. **Replicas.** Scale and roll per variant (``rollout.py``), placing new replicas on
   warm nodes first (``placement.py``).
6. **Clean-up.** A revision on a node that no variant wants and no replica uses any more
   is deleted from that node (after a rollout: the old version's cache). During a rollout
   the superseded (stable) revision is kept for a rollback, except on a node where the
   variant's new revision's warm-up is ``short_of_room`` (``unfit`` or ``failed`` because
   other copies hold the room: pinned, leased, reserved, or warmed and never used; not
   a disk too small for it) while the node holds the superseded copy and no replica uses
   it there: that copy is deleted so the new revision fits. A pinned old copy, or one a
   warm-up made and no replica used (which warm-ups spare), would otherwise keep the
   new revision off the node until the rollout finished, and the gate waiting for it
   until its timeout. A rollback then starts where the old revision still serves, or
   fetches.
"""

from __future__ import annotations

from preheat.control.fanout import Budget, Mode, WarmRequest, plan_fanout
from preheat.control.revocation import substitute
from preheat.control.rollout import effective_version, rollback_needed, step_variant
from preheat.control.state import (
    Action,
    CacheView,
    DeleteRevision,
    Desired,
    Notice,
    Observed,
    OpenGate,
    StopReplica,
    VariantStatus,
    WaitGate,
    Warm,
    revision_of,
    template_of,
)

__all__ = ["gate", "plan"]


def gate(
    desired: Desired, observed: Observed, variant: str, revision: str
) -> WaitGate | OpenGate | None:
    """The cache gate of one revision: ``None`` when there is none (cache disabled or
    already open), ``OpenGate`` when it opens now, ``WaitGate`` while it holds."""
    policy = desired.weights
    status = observed.status(variant)
    if not policy.enabled or revision in status.gate_open:
        return None
    targets = [n for n in observed.nodes if n.up and n.target]
    serving = {
        r.node
        for r in observed.replicas
        if r.variant == variant and r.revision != revision and r.phase != "stopped"
    }
    fit = [n for n in targets if _can_hold(n.cache_of(revision), n.name in serving)]
    needed = policy.min_ready if policy.min_ready is not None else len(fit)
    ready_nodes = [n.name for n in fit if n.holds(revision)]
    ready = len(ready_nodes)
    if ready >= needed:
        return OpenGate(variant, revision, ready, needed)
    since = status.waiting_since(revision)
    if since is not None and observed.now - since >= policy.timeout_seconds:
        return OpenGate(variant, revision, ready, needed, timed_out=True)
    waiting_on = tuple(n.name for n in fit if not n.holds(revision))
    return WaitGate(variant, revision, ready, needed, waiting_on)


def _can_hold(view: CacheView, serving_old: bool) -> bool:
    """Whether the gate waits for this node: not ``unfit``, and not short of room where
    the variant's other revision still serves (that copy's room comes free only when
    the rollout the gate holds up drains it). A node short of room elsewhere is waited
    for: step 6 may give it a superseded copy's room, or space may come free."""
    if view.short_of_room:
        return not serving_old
    return view.state != "unfit"


def _warms(observed: Observed, effective: dict[str, str], budget: Budget | None) -> list[Warm]:
    """Step 3: a ``Warm`` per (target node, wanted revision) that needs one, by node
    order; with a ``budget``, only those ``control.fanout.plan_fanout`` lets start now."""
    wanted = dict.fromkeys(effective.values())
    now = observed.now
    todo: list[Warm] = []
    for node in observed.nodes:
        if not (node.up and node.target):
            continue
        for rev in wanted:
            c = node.cache_of(rev)
            if (
                c.state == "absent"
                or (c.state == "failed" and now >= c.retry_at)
                or (c.state == "unfit" and 0.0 < c.retry_at <= now)
            ):
                variant = next(v for v, e in effective.items() if e == rev)
                todo.append(Warm(node.name, rev, variant))
    if budget is None or not todo:
        return todo
    # Revision granularity: a node that holds a revision ready is its complete holder,
    # a node warming one holds an origin slot (the conservative reading).
    up = [n for n in observed.nodes if n.up]
    complete = {n.name: frozenset(r for r, c in n.cache if c.state == "ready") for n in up}
    running = [(n.name, r) for n in up for r, c in n.cache if c.state == "warming"]
    requests = [WarmRequest(w.node, w.revision, frozenset({w.revision})) for w in todo]
    modes = plan_fanout(requests, complete, running, budget)
    return [w for w in todo if modes[(w.node, w.revision)] is not Mode.WAIT]


def plan(
    desired: Desired, observed: Observed, *, budget: Budget | None = None
) -> tuple[Action, ...]:
    """Everything to do now to move ``observed`` towards ``desired`` (see module doc).

    ``budget``: the cluster's origin budget for warm-ups (``control.fanout.Budget``);
    ``None`` asks every warm-up at once."""
    sub = substitute(desired, observed)
    desired, observed = sub.desired, sub.observed
    revoked = observed.revoked
    out: list[Action] = list(sub.actions)
    up = {n.name for n in observed.nodes if n.up}

    # 1. Replicas on lost nodes.
    lost = [r for r in observed.replicas if r.node not in up and r.phase != "stopped"]
    for r in lost:
        out.append(StopReplica(r.id, reason=f"node {r.node} is down"))
    lost_ids = {r.id for r in lost}
    replicas = tuple(r for r in observed.replicas if r.id not in lost_ids)

    # 2. Rollbacks; effective revisions after them.
    statuses: dict[str, VariantStatus] = {}
    effective: dict[str, str] = {}
    for dv in desired.variants:
        st = observed.status(dv.name)
        rb = rollback_needed(dv, st, replicas)
        if (
            rb is not None
            and revision_of(rb.to) not in revoked
            and template_of(rb.to) not in sub.revoked_templates
        ):
            out.append(rb)
            st = VariantStatus(
                stable=st.stable or rb.to,
                failed=st.failed | {dv.version},
                gate_open=st.gate_open,
                gate_since=st.gate_since,
            )
        statuses[dv.name] = st
        effective[dv.name] = revision_of(effective_version(dv.version, st))

    # 3. Warm every target node for every wanted revision (under the origin budget).
    if desired.weights.enabled:
        live = {v: r for v, r in effective.items() if r not in revoked}
        out.extend(_warms(observed, live, budget))

    # 4 + 5. Gate, then replica steps per variant.
    planned: dict[str, int] = {}
    for dv in desired.variants:
        rev = effective[dv.name]
        may_start = dv.name not in sub.held
        g = gate(desired, observed, dv.name, rev) if may_start else None
        if isinstance(g, WaitGate):
            out.append(g)
            may_start = False
        elif isinstance(g, OpenGate):
            out.append(g)
            if g.timed_out:
                out.append(
                    Notice(
                        f"{dv.name}: only {g.ready} of {g.needed} target nodes hold "
                        f"{rev[:12]} after {desired.weights.timeout_seconds:.0f} s; "
                        "deploying anyway (replicas on cold nodes fetch from the origin)"
                    )
                )
        out.extend(
            step_variant(
                dv,
                statuses[dv.name],
                replicas,
                observed.nodes,
                may_start=may_start,
                max_surge=desired.max_surge,
                planned=planned,
            )
        )

    # 6. Revisions nobody wants or uses.
    in_use = {(r.node, r.revision) for r in replicas if r.phase != "stopped"}
    in_use |= {(r.node, r.revision) for r in lost}
    # The stable revision stays until its rollout successor finishes (rollback needs it).
    wanted_revs = (
        set(effective.values())
        | {revision_of(st.stable) for st in statuses.values() if st.stable is not None}
    ) - revoked
    # A superseded revision yields its room to its own variant's new revision.
    superseded = {
        (effective[name], revision_of(st.stable))
        for name, st in statuses.items()
        if st.stable is not None and revision_of(st.stable) != effective[name]
    }
    for node in observed.nodes:
        if not node.up:
            continue
        yields = {
            old
            for new, old in superseded
            if old not in effective.values()
            and node.cache_of(new).short_of_room
            and node.holds(old)
            and (node.name, old) not in in_use
        }
        for rev, c in node.cache:
            if (rev in wanted_revs and rev not in yields) or (node.name, rev) in in_use:
                continue
            if c.state in ("ready", "failed"):
                out.append(DeleteRevision(node.name, rev))
    return tuple(out)
