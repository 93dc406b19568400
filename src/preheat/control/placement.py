"""Where a replica goes: prefer nodes that hold the revision, never require it.

Ranking of a candidate node for a replica of revision R (smaller is better):

1. cache state of R on the node: ``ready`` (a local read) before ``warming`` (the fill
   already running will finish sooner than a fresh download) before anything else (the
   replica downloads from the origin itself: the slow path, recorded as a miss);
2. replicas of the same variant already on the node (spread a variant);
3. replicas of any variant on the node (spread load);
4. the node's name (a stable tie-break, so the plan is repeatable).

A node is not a candidate when it is down, has no free slot, or is known to be unable to
hold R (cache state ``unfit``: its disk is too small). Being cold never excludes a node:
compute comes first, as in SageMaker HyperPod's and GPUStack's designs.

Scale-in picks victims in the opposite spirit: replicas that are not ready yet, then
replicas on nodes that do not hold their revision, then on the most loaded node, newest
first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from preheat.control.state import NodeView, ReplicaView

__all__ = ["Placement", "choose_victims", "occupied_slots", "place"]

_OCCUPYING = ("starting", "ready", "draining")
_CACHE_RANK = {"ready": 0, "warming": 1}


@dataclass(frozen=True)
class Placement:
    node: str
    warm: bool


def occupied_slots(replicas: Iterable[ReplicaView]) -> Counter[str]:
    """Slots in use per node (draining replicas still hold theirs)."""
    return Counter(r.node for r in replicas if r.phase in _OCCUPYING)


def place(
    nodes: Sequence[NodeView],
    replicas: Sequence[ReplicaView],
    *,
    variant: str,
    revision: str,
    count: int,
    planned: Mapping[str, int] | None = None,
) -> tuple[list[Placement], str]:
    """Choose nodes for ``count`` new replicas; returns the placements and, when fewer
    than ``count`` fit, why (empty string when all fit).

    ``planned`` counts replicas already placed by this same plan (other variants), so two
    variants planned in one tick do not both take the last slot.
    """
    used = occupied_slots(replicas)
    for name, n in (planned or {}).items():
        used[name] += n
    same = Counter(r.node for r in replicas if r.variant == variant and r.phase in _OCCUPYING)
    out: list[Placement] = []
    down = [n.name for n in nodes if not n.up]
    unfit = [n for n in nodes if n.up and n.cache_of(revision).state == "unfit"]
    for _ in range(count):
        candidates = [
            n
            for n in nodes
            if n.up and used[n.name] < n.slots and n.cache_of(revision).state != "unfit"
        ]
        if not candidates:
            break
        best = min(
            candidates,
            key=lambda n: (
                _CACHE_RANK.get(n.cache_of(revision).state, 2),
                same[n.name],
                used[n.name],
                n.name,
            ),
        )
        out.append(Placement(best.name, warm=best.holds(revision)))
        used[best.name] += 1
        same[best.name] += 1
    if len(out) == count:
        return out, ""
    parts = [
        f"all slots are taken on the {sum(1 for n in nodes if n.up) - len(unfit)} usable nodes"
    ]
    if unfit:
        parts.append(
            "too small for the model: "
            + "; ".join(f"{n.name} ({n.cache_of(revision).reason})" for n in unfit)
        )
    if down:
        parts.append("down: " + ", ".join(down))
    return out, "; ".join(parts) + "; add a node (preheat node add NAME) or raise slots"


def choose_victims(
    replicas: Sequence[ReplicaView], nodes: Sequence[NodeView], count: int
) -> list[ReplicaView]:
    """The ``count`` replicas to remove first on scale-in (see the module docstring)."""
    by_name = {n.name: n for n in nodes}
    load = occupied_slots(replicas)

    def key(r: ReplicaView) -> tuple[int, int, int, int]:
        node = by_name.get(r.node)
        holds = node is not None and node.holds(r.revision)
        return (0 if r.phase != "ready" else 1, 1 if holds else 0, -load[r.node], -r.seq)

    return sorted(replicas, key=key)[: max(0, count)]
