"""The one plug-in point of the router: a ``Policy`` chooses an instance for a request (pure).

Calling convention (the live proxy and the simulator both follow it):

1. the caller filters its instances to those that may take traffic (healthy, not
   draining) and calls ``choice = policy.choose(request, instances)``;
2. it increments ``choice.instance.in_flight`` and calls ``policy.on_sent(request, choice)``
   when the request is sent;
3. when the response ends it decrements ``in_flight`` and calls
   ``policy.on_done(request, choice, ok=..., cached_tokens=...)``.

The caller owns the in-flight counters (they outlive a strategy change); policies only
read them. ``forget(instance_id)`` is called when an instance leaves the variant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from preheat.errors import ConfigError
from preheat.router.prefix import check_prefix_length

PLACEMENTS = ("stable", "learned", "hash", "hybrid", "stable-split", "stable-move")
OUTCOMES = ("affinity", "spill", "fallback", "random", "least_outstanding", "hint")
#: Bounds of ``concurrency_threshold`` (in-flight requests per instance); the spec uses them too.
CONCURRENCY_THRESHOLD_RANGE = (1, 1024)


class InstanceLike(Protocol):
    """What a policy reads from an instance: a stable id (its URL) and its in-flight count."""

    @property
    def id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


InstT = TypeVar("InstT", bound=InstanceLike)


@dataclass(slots=True)
class Instance:
    """A minimal mutable instance record, for the simulator, tests and benchmarks."""

    id: str
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request to route.

    ``body`` is the parsed OpenAI request body; a caller that already has the canonical
    prompt text (the simulator) passes ``text`` instead. ``hint`` is the value of the
    ``X-Preheat-Prefix-Id`` header, which overrides the text-derived key.
    """

    request_id: str
    body: Mapping[str, Any] | None = None
    text: str | None = None
    hint: str | None = None


class Choice(NamedTuple, Generic[InstT]):
    """A policy's decision: the instance, and why (for metrics and the decision log).

    ``rank`` is how many preferred candidates were passed over for load (0: the first
    preference got the request). ``state`` is policy-private data for ``on_sent``.
    Immutable; a NamedTuple because one is built per request on the hot path.
    """

    instance: InstT
    outcome: str
    rank: int = 0
    matched_blocks: int = 0
    prefix_blocks: int = 0
    predicted_cached_tokens: int | None = None
    prompt_chars: int | None = None
    state: Any = None


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Per-variant routing parameters (the units and reasons are in prefix_aware.py).

    prefix_length: characters of canonical prompt that form the key (1,024-65,536).
    concurrency_threshold: in-flight requests at which an instance takes no more (1-1,024).
    balance_epsilon: an instance above (1+epsilon) x mean in-flight is skipped (0.01-10).
    block_chars: characters per hashed block (512-16,384).
    index_entries: learned block hashes kept, in total (the memory bound; >= 1,000).
    max_holders: instances remembered per learned block (1-64).
    balance_window: decisions over which request shares are balanced (decay 1/window).
    load_weight: learned placement: how much the prefill queued on an instance (its
        requests in flight) weighs against the prefill this prompt would need there
        (0-100; 1 trusts the queue estimate fully; 0.05 by default, measured best for hit
        rate); hybrid/hash ignore it.
    placement: ``stable-move`` (the default: ``stable`` plus a once-only move of a heavy
        cold block off an overloaded instance, stable_move.py), ``stable`` (traffic-sized
        replica sets for hot prefixes, weighted rendezvous for cold ones, spill only at
        the cap; replicas agree on document and template traffic), ``stable-split`` (a
        heavy cold block copied instead of moved), ``learned`` (the least predicted TTFT over the
        capacity-modelled learned index, under the load and share bounds), ``hash`` (stateless
        rendezvous with the in-flight bound; replicas agree in any order) or ``hybrid``
        (stable home keys, hot homes spread, share bound; replicas agree whatever their
        in-flight counts when they see the same order).
    """

    prefix_length: int = 8192
    concurrency_threshold: int = 64
    balance_epsilon: float = 0.10
    block_chars: int = 2048
    index_entries: int = 200_000
    max_holders: int = 8
    balance_window: int = 1000
    load_weight: float = 0.05
    placement: str = "stable-move"

    def __post_init__(self) -> None:
        check_prefix_length(self.prefix_length)
        t = self.concurrency_threshold
        lo, hi = CONCURRENCY_THRESHOLD_RANGE
        if isinstance(t, bool) or not isinstance(t, int) or not lo <= t <= hi:
            raise ConfigError(
                f"concurrency_threshold {t!r} is outside {lo}-{hi} in-flight requests per instance"
            )
        e = self.balance_epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0.01 <= e <= 10:
            raise ConfigError(f"balance_epsilon {e!r} is outside 0.01-10; 0.1 allows 10% skew")
        if not 512 <= self.block_chars <= 16384:
            raise ConfigError(f"block_chars {self.block_chars} is outside 512-16384; use 2048")
        if self.index_entries < 1000:
            raise ConfigError(f"index_entries {self.index_entries} is below 1000")
        w = self.balance_window
        if isinstance(w, bool) or not isinstance(w, int) or not 10 <= w <= 1_000_000:
            raise ConfigError(f"balance_window {w!r} is outside 10-1000000 decisions")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        lw = self.load_weight
        if isinstance(lw, bool) or not isinstance(lw, (int, float)) or not 0 <= lw <= 100:
            raise ConfigError(f"load_weight {lw!r} is outside 0-100; 1 is the default")
        if not 1 <= self.max_holders <= 64:
            raise ConfigError(f"max_holders {self.max_holders} is outside 1-64")


class Policy(Protocol[InstT]):
    """A routing strategy. ``choose`` raises ``NoHealthyInstance`` for an empty list."""

    name: str

    def choose(self, request: RouteRequest, instances: Sequence[InstT]) -> Choice[InstT]: ...

    def on_sent(self, request: RouteRequest, choice: Choice[InstT]) -> None: ...

    def on_done(
        self, request: RouteRequest, choice: Choice[InstT], *, ok: bool, cached_tokens: int | None
    ) -> None: ...

    def set_capacity(self, instance_id: str, tokens: int | None) -> None: ...

    def forget(self, instance_id: str) -> None: ...


class BasePolicy(Generic[InstT]):
    """No-op hooks, so a strategy implements only ``choose`` and what it needs."""

    name = "base"

    def on_sent(self, request: RouteRequest, choice: Choice[InstT]) -> None:
        return None

    def on_done(
        self, request: RouteRequest, choice: Choice[InstT], *, ok: bool, cached_tokens: int | None
    ) -> None:
        return None

    def set_capacity(self, instance_id: str, tokens: int | None) -> None:
        """The instance's KV capacity in tokens, as its engine reports it (None: unknown)."""
        return None

    def forget(self, instance_id: str) -> None:
        return None
