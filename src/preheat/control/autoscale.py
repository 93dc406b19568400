"""Autoscaling on in-flight requests per replica (pure: the caller measures and keeps time).

Rule (``autoscaling: {targetInFlight: T, scaleInBelow: B, cooldownSeconds: C}``):

- ``load`` is the mean number of requests in flight across the variant over a short
  window, as the router counts them (sent and not yet finished), divided by the
  replicas that serve (ready and in the router).
- Scale out when load > T: to ``ceil(in_flight / T)`` replicas at once (so a burst is
  met in one step), capped at ``replicas.max``. Replicas already asked for but still
  starting count: when ``current`` already covers ``ceil(in_flight / T)`` nothing is added
  (otherwise every cooldown during a slow cold start would add one more).
- From zero replicas (``replicas.min: 0``), any request in flight asks for
  ``max(1, ceil(in_flight / T))``.
- Scale in when load < B has held for C seconds: one replica at a time, never below
  ``replicas.min``. One replica at a time because a scale-in that overshoots costs a cold
  start later, while an extra replica only costs idle capacity. Replicas still starting
  (``serving < current``) do not block it (a start that never finishes would pin the
  count after demand dropped); then it only never goes below ``ceil(in_flight / T)``,
  so requests in flight keep a replica coming.
- After any change, wait C seconds before the next one (new replicas need time to take
  load; without this the count oscillates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from preheat.control.spec_types import Autoscaling

__all__ = ["AutoscaleState", "autoscale"]


@dataclass(frozen=True)
class AutoscaleState:
    last_change: float = float("-inf")
    #: Since when the load has been below ``scale_in_below`` (``None``: it is not).
    low_since: float | None = None


def autoscale(
    *,
    current: int,
    lo: int,
    hi: int,
    in_flight: float,
    serving: int,
    policy: Autoscaling,
    now: float,
    state: AutoscaleState,
) -> tuple[int, AutoscaleState, str]:
    """The replica count to set now, the new state, and why (empty when unchanged)."""
    load = in_flight / max(serving, 1)
    low = load < policy.scale_in_below
    low_since = (state.low_since if state.low_since is not None else now) if low else None
    state = AutoscaleState(state.last_change, low_since)
    if now - state.last_change < policy.cooldown_seconds:
        return current, state, ""
    need = math.ceil(in_flight / policy.target_in_flight)
    if current == 0 and in_flight > 0 and hi > 0:
        want = min(hi, max(1, need))
        return (
            want,
            AutoscaleState(now, None),
            f"{in_flight:.1f} in flight and no replica: 0 -> {want} replicas",
        )
    if load > policy.target_in_flight and current < hi and need > current:
        want = min(hi, need)
        return (
            want,
            AutoscaleState(now, None),
            f"{load:.1f} in flight per replica > {policy.target_in_flight:g}: "
            f"{current} -> {want} replicas",
        )
    if (
        low_since is not None
        and now - low_since >= policy.cooldown_seconds
        and current > lo
        and (serving >= current or current - 1 >= need)
    ):
        return (
            current - 1,
            AutoscaleState(now, None),
            f"{load:.1f} in flight per replica < {policy.scale_in_below:g} for "
            f"{policy.cooldown_seconds:g} s: {current} -> {current - 1} replicas",
        )
    return current, state, ""
