"""The simulated fleet's state, the views the planner sees, and the demand ledger.

Pure. ``FleetState`` owns the nodes (``NodeDisk``), replicas, fills (downloads of
weights in flight), per-model state and the image stores; it builds the ``NodeView``s and
``ReplicaView``s of ``control.state.Observed`` for each plan, and keeps the per-model
ledger of replicas wanted and not live (``account``). The executor's handlers build on
it: downloads in ``coldstart_fills``, a replica's life in ``coldstart_lifecycle``, the
dispatch of ``control.plan``'s actions in ``coldstart_world``.

With cache policy ``none`` there is no store: the views report no cache on any node.
"""

from __future__ import annotations

from preheat.control.fanout import Budget
from preheat.control.state import CacheView, NodeView, ReplicaView
from preheat.sim.coldstart_config import Catalog
from preheat.sim.coldstart_flows import Network
from preheat.sim.coldstart_images import Images
from preheat.sim.coldstart_replicas import Fill, ModelState, SimReplica
from preheat.sim.coldstart_store import Eviction, NodeDisk
from preheat.sim.events import EventQueue
from preheat.telemetry.records import StartRecord
from preheat.timing import get_profile

__all__ = ["FleetState"]


class FleetState:
    """Nodes, replicas, fills and models, with the planner's views of them."""

    def __init__(
        self,
        catalog: Catalog,
        agenda: EventQueue,
        network: Network,
        *,
        store: bool,
        peers: bool,
        priorities: bool,
        budget: Budget | None = None,
    ) -> None:
        self.catalog = catalog
        self.agenda = agenda
        self.net = network
        self.store = store
        self.peers = peers
        self.priorities = priorities
        #: The origin budget warm-ups are admitted under (``coldstart_fills``).
        self.budget = budget
        self.nodes: dict[str, NodeDisk] = {}
        self.replicas: dict[str, SimReplica] = {}
        self.fills: dict[tuple[str, str], Fill] = {}
        self.by_transfer: dict[int, Fill] = {}
        self.failed_views: dict[tuple[str, str], CacheView] = {}
        #: Warm-ups the budget holds back: (node, revision), retried when a fill ends.
        self.held: set[tuple[str, str]] = set()
        self.models: dict[str, ModelState] = {}
        self.pins: dict[str, bool] = {}
        self.records: list[StartRecord] = []
        self.evictions: list[Eviction] = []
        self.warmups = 0
        self.restarts = 0
        self.images = Images(network)
        self.notices: list[str] = []
        self.dirty: set[str] = set()
        self._seq = 0
        #: Bytes of every revision the run releases (``ModelSpec.size_at``).
        self.sizes = {
            m.revision_at(k): m.size_at(k)
            for m in catalog.models
            for k in range(len(m.releases) + 1)
        }
        #: Superseded revisions the planner deleted from a node (``DeleteRevision``).
        self.deleted: list[tuple[float, str, str]] = []
        self.rollouts_finished = 0
        #: When each released revision's rollout began (popped when it finishes), and how
        #: long each finished rollout took, release to ``FinishRollout``.
        self.released_at: dict[str, float] = {}
        self.rollout_seconds: dict[str, float] = {}
        self._first_response = {
            m.name: get_profile(m.profile).prefill_time(catalog.startup.first_prompt_tokens)
            for m in catalog.models
        }

    # --- views for the planner ----------------------------------------------------------

    def view(self, node: NodeDisk, revision: str) -> CacheView | None:
        if node.holds(revision):
            return CacheView("ready")
        if (node.name, revision) in self.fills:
            return CacheView("warming")
        return self.failed_views.get((node.name, revision))

    def node_views(self, model: str, targets: set[str] | None) -> tuple[NodeView, ...]:
        """Each node as one endpoint's controller sees it: the model's revisions (the
        current one and those released before it) and their cache states, so the planner
        also sees a superseded revision still on disk (and deletes it once unused)."""
        revisions = self.models[model].revisions
        out = []
        for n in self.nodes.values():
            cache: tuple[tuple[str, CacheView], ...] = ()
            if self.store:
                views = ((rev, self.view(n, rev)) for rev in revisions)
                cache = tuple((rev, v) for rev, v in views if v is not None)
            out.append(
                NodeView(
                    name=n.name,
                    up=n.up,
                    slots=n.slots,
                    target=targets is None or n.name in targets,
                    cache=cache,
                )
            )
        return tuple(out)

    def replica_views(self) -> tuple[ReplicaView, ...]:
        return tuple(
            ReplicaView(r.id, r.model, r.revision, r.node, r.phase, r.routed, r.seq)  # type: ignore[arg-type]
            for r in self.replicas.values()
        )

    def live(self, model: str) -> int:
        return sum(
            1
            for r in self.replicas.values()
            if r.model == model and r.phase in ("starting", "ready")
        )

    def serving(self, model: str) -> int:
        return sum(1 for r in self.replicas.values() if r.model == model and r.phase == "ready")

    # --- the demand ledger ----------------------------------------------------------------

    def account(self, model: str, *, started: bool = False) -> None:
        """Replicas wanted and not live: a rise opens demand; a start fills it; any other
        fall (the demand went away first) withdraws it, counted as unmet."""
        ms = self.models[model]
        gap = max(ms.desired - self.live(model), 0)
        delta = gap - ms.gap
        if delta > 0:
            ms.opened += delta
        elif delta < 0 and started:
            ms.filled += -delta
        elif delta < 0:
            ms.withdrawn += -delta
        ms.gap = gap

    def mark_all(self) -> None:
        self.dirty.update(self.models)
