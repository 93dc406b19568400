"""``least_outstanding``: the instance with the fewest in-flight requests.

Ties are broken at random (injected ``random.Random``) so that equal instances share
traffic instead of the first one in the list taking every tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from preheat.errors import NoHealthyInstance
from preheat.router.policies.base import BasePolicy, Choice, InstT, PolicyParams, RouteRequest

if TYPE_CHECKING:
    import random as _random


class LeastOutstandingPolicy(BasePolicy[InstT]):
    """Join the shortest queue, as counted by this router's own in-flight requests."""

    name = "least_outstanding"

    def __init__(self, params: PolicyParams, *, salt: bytes, rng: _random.Random) -> None:
        self.params = params
        self._rng = rng

    def choose(self, request: RouteRequest, instances: Sequence[InstT]) -> Choice[InstT]:
        if not instances:
            raise NoHealthyInstance("no instance can take the request")
        low = min(i.in_flight for i in instances)
        ties = [i for i in instances if i.in_flight == low]
        pick = ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
        return Choice(instance=pick, outcome="least_outstanding")
