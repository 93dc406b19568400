"""Routing policies, one module each, behind one ``Policy`` protocol (pure).

``POLICIES`` maps a strategy name to its class; ``make_policy`` builds one from typed
parameters. The live router and the simulator use the same objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from preheat.errors import ConfigError
from preheat.router.policies.base import (
    OUTCOMES,
    BasePolicy,
    Choice,
    Instance,
    InstanceLike,
    Policy,
    PolicyParams,
    RouteRequest,
)
from preheat.router.policies.least_outstanding import LeastOutstandingPolicy
from preheat.router.policies.prefix_aware import LearnedIndex, PrefixAwarePolicy
from preheat.router.policies.random import RandomPolicy

if TYPE_CHECKING:
    import random as _random

POLICIES: dict[str, type[Any]] = {
    "random": RandomPolicy,
    "least_outstanding": LeastOutstandingPolicy,
    "prefix_aware": PrefixAwarePolicy,
}


def make_policy(
    strategy: str, params: PolicyParams, *, salt: bytes, rng: _random.Random
) -> Policy[Any]:
    """Build the policy named ``strategy``; ``ConfigError`` names the choices if unknown."""
    cls = POLICIES.get(strategy)
    if cls is None:
        raise ConfigError(
            f"strategy {strategy!r} is unknown; choose one of {', '.join(sorted(POLICIES))}"
        )
    policy: Policy[Any] = cls(params, salt=salt, rng=rng)
    return policy


__all__ = [
    "OUTCOMES",
    "POLICIES",
    "BasePolicy",
    "Choice",
    "Instance",
    "InstanceLike",
    "LearnedIndex",
    "LeastOutstandingPolicy",
    "Policy",
    "PolicyParams",
    "PrefixAwarePolicy",
    "RandomPolicy",
    "RouteRequest",
    "make_policy",
]
