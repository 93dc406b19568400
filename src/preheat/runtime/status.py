"""The fleet's status document and per-node inventories (what `preheat status` shows).

``status_document`` is the JSON-able picture `preheat status --json` prints and
`cli.fleet.render_status` draws: router, variants (revision, stable, failed, ready vs
desired, what each waits for), nodes (up, target, slots, disk, a cache state per
revision with progress and reason), replicas (phase, routed, weights source, restarts,
detail), revisions, counters and the last messages. ``inventories`` joins each node's
store with the controller's readiness and last warm-up failure (``NodeInventory``).

Reasons and details are redacted (``redact_url``) once more here: whatever produced
them, no source credential reaches the document, the control API or a terminal.
"""

from __future__ import annotations

from typing import Any

from preheat.artifacts.refs import redact_url
from preheat.control.state import VariantStatus, revision_of
from preheat.runtime.model import FleetState, WarmState
from preheat.telemetry.inventory import NodeInventory, inventory_from_store

__all__ = ["inventories", "status_document"]


def _nodes(st: FleetState) -> list[dict[str, Any]]:
    out = []
    for n in st.nodes.values():
        cache = {}
        for rev, view in n.views.items():
            entry: dict[str, Any] = {"state": view.state}
            if view.reason:
                entry["reason"] = redact_url(view.reason)
            if rev in n.progress:
                done, total = n.progress[rev]
                entry["progress"] = [done, total]
            cache[rev] = entry
        out.append(
            {
                "name": n.spec.name,
                "up": n.up,
                "target": st.is_target(n),
                "slots": n.spec.slots,
                "replicas": sum(1 for r in st.live_replicas() if r.node == n.spec.name),
                "capacity": n.spec.capacity,
                "used": n.cache.used_bytes(),
                "labels": dict(n.spec.labels),
                "cache": cache,
            }
        )
    return out


def _variants(st: FleetState) -> list[dict[str, Any]]:
    out = []
    for v in st.spec.variants:
        rv = st.resolved.get(v.name)
        vs = st.statuses.get(v.name, VariantStatus())
        waiting = st.waiting.get(v.name)
        out.append(
            {
                "name": v.name,
                "source": redact_url(v.model.source),
                "revision": rv.revision if rv else None,
                "model_bytes": rv.model_bytes if rv else None,
                "stable": revision_of(vs.stable) if vs.stable else None,
                "stable_version": vs.stable,
                "failed": sorted(vs.failed),
                "replicas": st.replica_counts.get(v.name, 0),
                "ready": st.ready_count(v.name),
                "waiting": redact_url(waiting) if waiting else waiting,
                "weight": v.weight,
                # Set while the variant's revision is revoked (Degraded when no fallback).
                "revoked": st.revoked.get(v.name),
            }
        )
    return out


def status_document(st: FleetState, *, router_url: str, events: str) -> dict[str, Any]:
    """A JSON-able picture of the fleet (what `preheat status` prints)."""
    revs = {rv.revision: rv for rv in st.resolved.values()}
    replicas = [
        {
            "id": r.id,
            "variant": r.variant,
            "revision": r.revision,
            "node": r.node,
            "phase": r.phase.value,
            "routed": r.routed,
            "url": r.url if r.port else None,
            "restarts": r.restarts,
            "weights": r.weights_source,
            "detail": redact_url(r.detail),
        }
        for r in sorted(st.live_replicas(), key=lambda r: r.seq)
    ]
    routing = st.spec.routing
    return {
        "endpoint": st.spec.name,
        "router": {
            "url": router_url,
            "strategy": routing.strategy,
            "prefix_length": routing.prefix_length,
            "concurrency_threshold": routing.concurrency_threshold,
        },
        "resolving": redact_url(st.resolve_error) if st.resolve_error else None,
        "variants": _variants(st),
        "nodes": _nodes(st),
        "replicas": replicas,
        "revisions": {
            r: {
                "bytes": rv.model_bytes,
                "files": rv.files,
                "origin_bytes": sum(n for (_, rev), n in st.origin_bytes.items() if rev == r),
            }
            for r, rv in revs.items()
        },
        "warmups": [w.to_dict() for _, w in sorted(st.warmups.items())],
        "starts": st.starts_total,
        "restarts": st.restarts_total,
        "events": events,
        "messages": list(st.log.messages),
    }


def inventories(st: FleetState) -> list[NodeInventory]:
    """Each node's cache (from its store) joined with the controller's readiness and its
    last warm-up failure, for reports and `/metrics`. Reads the stores: may run in a
    worker thread, so it iterates copies."""
    out = []
    for n in list(st.nodes.values()):
        if n.cache.closed:
            continue
        out.append(
            inventory_from_store(
                n.spec.name,
                n.cache.store,
                capacity_bytes=n.spec.capacity,
                ready={rev: v.state == WarmState.READY for rev, v in list(n.views.items())},
                last_warmup_failure=n.last_failure,
            )
        )
    return out
