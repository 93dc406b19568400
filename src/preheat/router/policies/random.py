"""``random``: a uniformly random instance (the SageMaker default; the baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from preheat.errors import NoHealthyInstance
from preheat.router.policies.base import BasePolicy, Choice, InstT, PolicyParams, RouteRequest

if TYPE_CHECKING:
    import random as _random


class RandomPolicy(BasePolicy[InstT]):
    """Pick any instance with equal probability; the random source is injected."""

    name = "random"

    def __init__(self, params: PolicyParams, *, salt: bytes, rng: _random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, request: RouteRequest, instances: Sequence[InstT]) -> Choice[InstT]:
        if not instances:
            raise NoHealthyInstance("no instance can take the request")
        return Choice(instance=instances[self._rng.randrange(len(instances))], outcome="random")
