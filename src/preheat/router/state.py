"""The router's routing state: variants, their instances and policies, config changes.

No HTTP here (the proxy, the health checker and the admin API all act through it), so
it is testable without aiohttp or a socket:

* ``apply(config)`` switches to a validated config, keeping the instances (state,
  in-flight count) and the policies (learned index) of variants that stay; a policy is
  rebuilt only when its shape (strategy, prefix length, block size, index size, holders)
  changes, otherwise the per-decision parameters are changed in place;
* ``set_state(instance, state)`` moves an instance between healthy, unhealthy and
  draining (only healthy ones are ``live``: they take new requests);
* ``variant_for(name)`` picks the variant of a request (by name, else by weight among
  those with a live instance);
* ``snapshot()`` is the ``GET /admin/config`` document.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

from preheat.errors import ConfigError
from preheat.router.config import RouterConfig, VariantConfig, restart_only_changes
from preheat.router.metrics import RouterMetrics
from preheat.router.policies import Policy, make_policy

log = logging.getLogger("preheat.router")

VARIANT_HEADER = "X-Preheat-Variant"
STATES = ("healthy", "unhealthy", "draining")


@dataclass(eq=False, slots=True)
class Upstream:
    """One instance as the router sees it: URL (its id), state and in-flight count."""

    id: str
    variant: str
    in_flight: int = 0
    state: str = "healthy"
    failures: int = 0


@dataclass(eq=False)
class VariantRuntime:
    """A variant's config, policy and instances; ``live`` are those that take traffic."""

    config: VariantConfig
    policy: Policy[Upstream]
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    live: list[Upstream] = field(default_factory=list)

    def refresh(self) -> None:
        self.live = [u for u in self.upstreams.values() if u.state == "healthy"]


class RoutingState:
    """Variants with their policies and instances, the config they came from, and the
    metrics that describe them (health, in flight)."""

    def __init__(
        self, config: RouterConfig, *, salt: bytes, rng: random.Random | None = None
    ) -> None:
        self.salt = salt
        self.rng = rng or random.Random()
        self.metrics = RouterMetrics(in_flight_source=self._in_flight)
        self.variants: dict[str, VariantRuntime] = {}
        self.config = config
        self._apply(config)

    # --- configuration --------------------------------------------------------------------

    def _apply(self, config: RouterConfig) -> None:
        """Switch to ``config`` (already validated), keeping instances and policies that stay."""
        new: dict[str, VariantRuntime] = {}
        for vc in config.variants:
            old = self.variants.get(vc.name)
            policy = None
            if old is not None:
                op = old.config.params
                np_ = vc.params
                same_shape = (
                    old.config.strategy == vc.strategy
                    and op.prefix_length == np_.prefix_length
                    and op.block_chars == np_.block_chars
                    and op.index_entries == np_.index_entries
                    and op.max_holders == np_.max_holders
                )
                if same_shape:
                    policy = old.policy
                    # Threshold and epsilon are read per decision: change them in place
                    # and keep the learned index.
                    policy.params = np_  # type: ignore[attr-defined]
            if policy is None:
                policy = make_policy(vc.strategy, vc.params, salt=self.salt, rng=self.rng)
            rt = VariantRuntime(config=vc, policy=policy)
            for url in vc.instances:
                up = old.upstreams.get(url) if old is not None else None
                rt.upstreams[url] = up if up is not None else Upstream(id=url, variant=vc.name)
            if old is not None:
                for url in old.upstreams:
                    if url not in rt.upstreams:
                        if policy is old.policy:
                            policy.forget(url)
                        self.metrics.forget(vc.name, url)
            rt.refresh()
            new[vc.name] = rt
        for name, old in self.variants.items():
            if name not in new:
                for url in old.upstreams:
                    self.metrics.forget(name, url)
        self.variants = new
        self.config = config
        for rt in new.values():
            for u in rt.upstreams.values():
                self._export_health(u)

    def replace_config(self, config: RouterConfig) -> None:
        """Apply a validated config; instances that stay keep their state and counters.

        A change to a field that only takes effect at start (``RESTART_ONLY`` in
        config.py) is refused with ``ConfigError`` and the current config stays.
        """
        changed = restart_only_changes(self.config, config)
        if changed:
            raise ConfigError(
                "; ".join(changed) + ": fixed when the router starts; restart the router "
                "with the new value (nothing was changed)"
            )
        self._apply(config)

    def set_state(self, up: Upstream, state: str) -> None:
        if state not in STATES:
            raise ConfigError(f"instance state {state!r} is not one of {STATES}")
        if up.state != state:
            log.info("instance %s: %s -> %s", up.id, up.state, state)
            up.state = state
            rt = self.variants.get(up.variant)
            if rt is not None and rt.upstreams.get(up.id) is up:
                rt.refresh()
            self._export_health(up)

    def _export_health(self, up: Upstream) -> None:
        self.metrics.child(self.metrics.healthy, up.variant, up.id).set(
            1 if up.state == "healthy" else 0
        )

    def _in_flight(self) -> list[tuple[str, str, int]]:
        return [
            (name, u.id, u.in_flight)
            for name, rt in self.variants.items()
            for u in rt.upstreams.values()
        ]

    # --- reading ----------------------------------------------------------------------------

    def find(self, url: str) -> Upstream | None:
        for rt in self.variants.values():
            up = rt.upstreams.get(url)
            if up is not None:
                return up
        return None

    def upstreams(self) -> list[Upstream]:
        """Every instance of every variant (what the health checker probes)."""
        return [u for rt in self.variants.values() for u in rt.upstreams.values()]

    def variant_for(self, name: str | None) -> VariantRuntime:
        """The variant named ``name`` (the request's variant header), else one by weight
        among those with a live instance (by weight alone when none has one)."""
        if name is not None:
            rt = self.variants.get(name)
            if rt is None:
                raise ConfigError(
                    f"{VARIANT_HEADER} {name!r} is unknown; known: {', '.join(self.variants)}"
                )
            return rt
        rts = list(self.variants.values())
        if len(rts) == 1:
            return rts[0]
        weights = [rt.config.weight if rt.live else 0.0 for rt in rts]
        if sum(weights) <= 0:
            weights = [rt.config.weight for rt in rts]
        if sum(weights) <= 0:
            return rts[0]
        return self.rng.choices(rts, weights=weights)[0]

    def snapshot(self) -> dict[str, Any]:
        """The whole config as JSON, with each instance's state and in-flight count."""
        out = self.config.to_dict()
        for v in out["variants"]:
            rt = self.variants[v["name"]]
            v["instances"] = [
                {"url": u.id, "state": u.state, "in_flight": u.in_flight}
                for u in rt.upstreams.values()
            ]
        return out
