"""What the planner reads (desired and observed state) and what it returns (actions).

All frozen values; no I/O. The executor builds an ``Observed`` from the node stores, its
replica processes and its own bookkeeping, calls ``plan(desired, observed)``, and carries
out the actions. Planning is level-triggered: the same state gives the same actions, and
work already in flight (a cache ``warming``, a replica ``starting``) is visible in the
state, so a second tick never starts it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from typing import TypeAlias

__all__ = [
    "ACTION_TYPES",
    "Action",
    "AddRoute",
    "CacheView",
    "DeleteRevision",
    "Desired",
    "DesiredVariant",
    "Drain",
    "FinishRollout",
    "NodeView",
    "Notice",
    "Observed",
    "OpenGate",
    "ReplicaView",
    "Revoked",
    "Rollback",
    "StartReplica",
    "StopReplica",
    "Unschedulable",
    "VariantStatus",
    "WaitGate",
    "Warm",
    "WeightsPolicy",
    "revision_of",
    "template_of",
    "version_of",
]

CacheState = Literal["absent", "warming", "ready", "failed", "unfit"]
ReplicaPhase = Literal["starting", "ready", "draining", "stopped", "failed"]
StartReason = Literal["initial", "scale_out", "replace", "rollout"]


# --- versions -----------------------------------------------------------------------------

#: A *version* is what a rollout rolls: the model revision plus a fingerprint of how the
#: replica runs it (engine command or profile, image). Caches are keyed by the revision
#: alone, so a new image or engine flag rolls replicas without moving any weights.
_SEP = "#"


def version_of(revision: str, template: str = "") -> str:
    return f"{revision}{_SEP}{template}" if template else revision


def revision_of(version: str) -> str:
    return version.split(_SEP, 1)[0]


def template_of(version: str) -> str:
    return version.split(_SEP, 1)[1] if _SEP in version else ""


# --- desired ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DesiredVariant:
    """One variant with its source resolved to an immutable revision."""

    name: str
    revision: str
    model_bytes: int
    replicas: int
    weight: float = 1.0
    #: Fingerprint of engine and image; part of the version, not of the cache key.
    template: str = ""
    #: The spec's other allowed revisions (``model.fallback``), resolved, in order of
    #: preference: ``(revision, model_bytes)``. Used only when ``revision`` is revoked.
    fallbacks: tuple[tuple[str, int], ...] = ()
    #: The digests naming the image ``template`` runs (image manifest, and the index it
    #: was chosen from), as the image cache resolved its tag; empty when not known.
    image: tuple[str, ...] = ()
    #: The spec's ``image.fallback`` list, resolved, in order of preference:
    #: ``(image digests, template that runs it)``. Used only when ``image`` is revoked.
    image_fallbacks: tuple[tuple[tuple[str, ...], str], ...] = ()

    @property
    def version(self) -> str:
        return version_of(self.revision, self.template)


@dataclass(frozen=True)
class WeightsPolicy:
    """``modelCacheConfig.weights`` with its node selector already evaluated per node."""

    enabled: bool = False
    min_ready: int | None = None
    timeout_seconds: float = 600.0
    pin: bool = False
    priority: int = 0


@dataclass(frozen=True)
class Desired:
    endpoint: str
    variants: tuple[DesiredVariant, ...]
    weights: WeightsPolicy = field(default_factory=WeightsPolicy)
    #: Extra new-version replicas allowed during a rollout (above the desired count).
    max_surge: int = 1


# --- observed -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheView:
    """One revision on one node, as far as this controller is concerned."""

    state: CacheState
    #: Why it is failed/unfit, with the numbers (shown in status).
    reason: str = ""
    #: A failed warm-up may be retried at or after this time (``observed.now`` scale).
    retry_at: float = 0.0
    #: The last warm-up (``failed`` or ``unfit``) found no room the node could give now:
    #: other copies hold it (pinned, leased, reserved, or warmed and not used yet), so
    #: deleting one may let it fit (``control.plan`` step 6).
    short_of_room: bool = False


@dataclass(frozen=True)
class NodeView:
    name: str
    up: bool = True
    slots: int = 2
    #: Whether ``modelCacheConfig.weights.nodes`` selects this node.
    target: bool = True
    #: revision -> cache state; revisions this controller never touched are absent.
    cache: tuple[tuple[str, CacheView], ...] = ()

    def cache_of(self, revision: str) -> CacheView:
        for rev, view in self.cache:
            if rev == revision:
                return view
        return CacheView("absent")

    def holds(self, revision: str) -> bool:
        return self.cache_of(revision).state == "ready"


@dataclass(frozen=True)
class ReplicaView:
    id: str
    variant: str
    revision: str
    node: str
    phase: ReplicaPhase
    routed: bool = False
    #: Monotonic order of creation (newer replicas are drained first on scale-in).
    seq: int = 0
    template: str = ""

    @property
    def version(self) -> str:
        return version_of(self.revision, self.template)


@dataclass(frozen=True)
class VariantStatus:
    """The executor's memory of a variant between ticks."""

    #: The version that last finished rolling out (serves while a new one rolls).
    stable: str | None = None
    #: Versions whose rollout failed; never tried again until the spec changes.
    failed: frozenset[str] = frozenset()
    #: Revisions whose cache gate opened (latched: later node loss does not re-gate).
    gate_open: frozenset[str] = frozenset()
    #: revision -> time the gate started waiting.
    gate_since: tuple[tuple[str, float], ...] = ()

    def waiting_since(self, revision: str) -> float | None:
        for rev, t in self.gate_since:
            if rev == revision:
                return t
        return None


@dataclass(frozen=True)
class Observed:
    now: float
    nodes: tuple[NodeView, ...]
    replicas: tuple[ReplicaView, ...] = ()
    variants: tuple[tuple[str, VariantStatus], ...] = ()
    #: Revisions on the cluster-wide revocation list (``control.revocation``).
    revoked: frozenset[str] = frozenset()

    def status(self, variant: str) -> VariantStatus:
        for name, st in self.variants:
            if name == variant:
                return st
        return VariantStatus()

    def node(self, name: str) -> NodeView | None:
        for n in self.nodes:
            if n.name == name:
                return n
        return None


# --- actions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Warm:
    """Fill ``revision`` into ``node``'s store (bandwidth-limited origin download)."""

    node: str
    revision: str
    variant: str


@dataclass(frozen=True)
class WaitGate:
    """Replicas of ``revision`` wait until ``needed`` target nodes hold it."""

    variant: str
    revision: str
    ready: int
    needed: int
    waiting_on: tuple[str, ...]


@dataclass(frozen=True)
class OpenGate:
    """The cache gate of ``revision`` opens (``timed_out``: it deploys anyway)."""

    variant: str
    revision: str
    ready: int
    needed: int
    timed_out: bool = False


@dataclass(frozen=True)
class StartReplica:
    variant: str
    revision: str
    node: str
    #: The node already holds the revision (a cache hit is expected).
    warm: bool
    reason: StartReason
    template: str = ""


@dataclass(frozen=True)
class Unschedulable:
    """No node can take a replica that is wanted."""

    variant: str
    revision: str
    missing: int
    reason: str


@dataclass(frozen=True)
class AddRoute:
    replica: str


@dataclass(frozen=True)
class Drain:
    """Take the replica out of the router, let its in-flight requests finish, stop it."""

    replica: str
    reason: str


@dataclass(frozen=True)
class StopReplica:
    """Stop at once (a replica on a lost node, or a failed one being cleaned up)."""

    replica: str
    reason: str


@dataclass(frozen=True)
class FinishRollout:
    """Every live replica of the variant runs version ``revision``: it becomes stable."""

    variant: str
    revision: str
    previous: str | None


@dataclass(frozen=True)
class Rollback:
    """A replica of version ``revision`` failed during a rollout: go back to ``to``."""

    variant: str
    revision: str
    to: str
    reason: str


@dataclass(frozen=True)
class DeleteRevision:
    """No variant wants ``revision`` and no replica uses it: drop it from the node."""

    node: str
    revision: str


@dataclass(frozen=True)
class Revoked:
    """``revision`` of ``variant`` is revoked (``kind="image"``: the image digest its
    replicas run): its replicas roll to ``to`` (the spec's first allowed fallback that is
    not revoked), or, with none, the variant is Degraded and no new replica of it starts
    (``control.revocation``)."""

    variant: str
    revision: str
    to: str | None
    kind: Literal["revision", "image"] = "revision"

    @property
    def message(self) -> str:
        what = "image" if self.kind == "image" else "revision"
        if self.to is not None:
            return (
                f"{self.variant}: {what} {self.revision[:24]} is revoked; rolling to "
                f"fallback {self.to[:24]}"
            )
        fix = (
            "image.fallback, or apply a new image"
            if self.kind == "image"
            else ("model.fallback, or apply a new model revision")
        )
        return (
            f"{self.variant}: {what} {self.revision[:24]} is revoked and the spec allows no "
            f"other {what} that is not (set {fix}); serving replicas keep running, no new "
            "one starts"
        )


@dataclass(frozen=True)
class Notice:
    """Something the operator should read in status (not an action on the world)."""

    text: str


#: Every action type, for run-time code (``runtime.reconcile`` maps each to a method).
#: ``Action`` is the same set as a type, quoted so that importing this module evaluates
#: no ``X | Y`` of classes: Python 3.9, which benchmarks/pypy.py runs the cold-start
#: simulator on, cannot (tests/unit/test_runtime_reconcile.py checks that the two agree).
ACTION_TYPES = (
    Warm,
    WaitGate,
    OpenGate,
    StartReplica,
    Unschedulable,
    AddRoute,
    Drain,
    StopReplica,
    FinishRollout,
    Rollback,
    DeleteRevision,
    Revoked,
    Notice,
)
Action: TypeAlias = (
    "Warm | WaitGate | OpenGate | StartReplica | Unschedulable | AddRoute | Drain"
    " | StopReplica | FinishRollout | Rollback | DeleteRevision | Revoked | Notice"
)
