"""The simulated fleet's replicas, downloads and per-model state, and their start records.

Pure values the executor (``coldstart_world``) keeps; ``start_record`` turns a replica's
stamps into the ``StartRecord`` the live supervisor would write.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from preheat.control.state import VariantStatus
from preheat.sim.coldstart_config import ModelSpec
from preheat.sim.coldstart_flows import ORIGIN
from preheat.telemetry.records import EventClass, StartRecord

__all__ = ["Fill", "ModelState", "SimReplica", "start_record"]


@dataclass
class SimReplica:
    id: str
    model: str
    revision: str
    node: str
    seq: int
    event_class: EventClass
    scheduled: float
    phase: str = "starting"  # starting | ready | draining | stopped | failed
    routed: bool = False
    weights_source: str = "cache"
    bytes_from: dict[str, int] = field(default_factory=dict)
    stamps: dict[str, float] = field(default_factory=dict)
    leased: bool = False
    image_source: str | None = None
    #: When the weights were on the node (the runtime also waits for the image).
    weights_at: float | None = None
    #: ``startup.image_pull: before``: the weights download waits for the image.
    deferred_fill: bool = False
    restarts: int = 0


@dataclass
class Fill:
    node: str
    revision: str
    size: int
    transfer: int
    source: str  # ORIGIN or a peer node
    #: ``warm`` (a planner Warm) or the id of the replica that pulls for itself.
    owner: str
    waiters: list[str] = field(default_factory=list)
    fetched: Counter[str] = field(default_factory=Counter)

    @property
    def kind(self) -> str:
        return "origin" if self.source == ORIGIN else "peer"


@dataclass
class ModelState:
    spec: ModelSpec
    desired: int
    status: VariantStatus = field(default_factory=VariantStatus)
    lost_pending: int = 0
    #: Demand ledger (see ``World.account``).
    gap: int = 0
    opened: int = 0
    filled: int = 0
    withdrawn: int = 0
    unschedulable: int = 0
    #: Failed starts in a row and when the next may begin (the live supervisor's backoff).
    start_failures: int = 0
    next_start_at: float = 0.0
    #: Releases so far (``ModelSpec.releases``): the spec's revision is the latest.
    release: int = 0

    @property
    def revision(self) -> str:
        """The revision the spec asks for now (what the planner rolls the replicas to)."""
        return self.spec.revision_at(self.release)

    @property
    def size(self) -> int:
        return self.spec.size_at(self.release)

    @property
    def revisions(self) -> tuple[str, ...]:
        """Every revision released so far, the current one first (the older ones may
        still be on disks and serving until the rollout drains them)."""
        return tuple(self.spec.revision_at(k) for k in range(self.release, -1, -1))


def start_record(r: SimReplica, end: float, failure: str | None) -> StartRecord:
    """The replica's start as a record; a failed start keeps the stamps it reached."""
    stamps = {k: v for k, v in r.stamps.items() if failure is None or v <= end}
    return StartRecord(
        endpoint="fleet",
        variant=r.model,
        replica=r.id,
        node=r.node,
        revision=r.revision,
        event_class=r.event_class,
        scheduled=r.scheduled,
        weights_source=r.weights_source,
        bytes_from=r.bytes_from,
        image_source=r.image_source,
        restart_count=r.restarts,
        failure=failure,
        **stamps,
    )
