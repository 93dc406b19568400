"""What one cold-start simulation runs: the fleet, the catalog, the traffic, the policy.

Pure: a frozen value validated on construction (every error a ``ConfigError`` naming
the value and the fix); ``coldstart_files.prepare`` builds it from the CLI's values and
``coldstart.simulate`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from preheat.errors import ConfigError
from preheat.sim.coldstart_config import CACHE_POLICIES, Catalog
from preheat.sim.traffic import Traffic

__all__ = ["ColdStartSetup"]


@dataclass(frozen=True)
class ColdStartSetup:
    nodes: int
    nvme: int
    catalog: Catalog
    traffic: Traffic
    policy: str
    duration: float
    origin_bandwidth: float = 10e9 / 8
    node_bandwidth: float = 25e9 / 8
    #: Shared by every image pull (``coldstart_images``), like ``origin_bandwidth``.
    registry_bandwidth: float = 10e9 / 8
    peers: bool = False
    slots: int = 1
    seed: int = 0
    high_watermark: float = 0.9
    #: Origin fills at once over the fleet under which a warm-up may start
    #: (``control.fanout.Budget``, admitted by the executor as the live node agent does;
    #: replicas' own fills count, so warm-ups yield the origin to starts); ``None``: every
    #: warm-up at once (what the Kubernetes agent still does with peers off; the local
    #: fleet admits through the budget with peers off too, ``runtime.peering.OriginGate``).
    #: ``coldstart_files.prepare`` (and the CLI) default to ``auto``.
    warm_budget: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in CACHE_POLICIES:
            raise ConfigError(
                f"cache policy {self.policy!r} is unknown; choose one of {', '.join(CACHE_POLICIES)}"
            )
        if self.nodes < 1 or self.slots < 1:
            raise ConfigError(f"--nodes {self.nodes} and --slots {self.slots} must be >= 1")
        if self.peers and self.policy == "none":
            raise ConfigError(
                "--peers on needs node stores to serve from; --cache-policy none keeps none "
                "(choose another policy or --peers off)"
            )
        if self.warm_budget is not None and self.warm_budget < 1:
            raise ConfigError(f"--warm-budget {self.warm_budget} must be at least 1 warm-up")
        if self.nvme <= 0 and self.policy != "none":
            raise ConfigError(f"--nvme {self.nvme} must be above zero, e.g. 3.5TB")
        for m in self.catalog.models:
            late = [r.at for r in m.releases if r.at >= self.duration]
            if late:
                raise ConfigError(
                    f"model {m.name!r} has a release at {late[0]:g} s, not before the run "
                    f"ends at {self.duration:g} s; lengthen --duration or drop the release"
                )
