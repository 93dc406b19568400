"""Autoscaling on in-flight requests per replica: burst out, step in, cooldown, bounds."""

from __future__ import annotations

from preheat.control.autoscale import AutoscaleState, autoscale
from preheat.control.spec import Autoscaling

POLICY = Autoscaling(target_in_flight=4, scale_in_below=1, cooldown_seconds=10)


def step(current: int, in_flight: float, serving: int, now: float, st: AutoscaleState):  # type: ignore[no-untyped-def]
    return autoscale(
        current=current, lo=1, hi=5, in_flight=in_flight, serving=serving,
        policy=POLICY, now=now, state=st,
    )  # fmt: skip


def test_burst_scales_out_in_one_step_capped() -> None:
    """18 in flight on 1 replica with target 4 asks for 5 replicas (ceil 18/4), max 5."""
    n, st, why = step(1, 18, 1, 0, AutoscaleState())
    assert n == 5 and "18.0 in flight per replica > 4" in why
    n, st, why = step(5, 100, 5, 100, st)
    assert n == 5 and why == ""  # already at max


def test_cooldown_blocks_the_next_change() -> None:
    """After a change nothing moves for cooldown seconds."""
    n, st, _ = step(1, 10, 1, 0, AutoscaleState())
    assert n == 3
    n2, st, why = step(n, 30, 3, 5, st)
    assert (n2, why) == (3, "")
    n3, _, _ = step(n2, 30, 3, 10, st)
    assert n3 == 5  # ceil(30/4) = 8, capped at max 5


def test_scale_in_one_at_a_time_after_sustained_low_load() -> None:
    """Low load must hold for the cooldown; then one replica goes, never below min."""
    st = AutoscaleState()
    n, st, why = step(3, 0, 3, 100, st)
    assert n == 3 and why == ""  # low since 100
    n, st, why = step(3, 0, 3, 105, st)
    assert n == 3
    n, st, why = step(3, 0, 3, 110, st)
    assert n == 2 and "< 1 for 10 s" in why
    n, st, _ = step(2, 2, 2, 125, st)  # load back to 1 per replica: not low
    assert n == 2 and st.low_since is None
    n, st, _ = step(1, 0, 1, 500, AutoscaleState())
    n, st, _ = step(1, 0, 1, 600, st)
    assert n == 1  # min


def test_scale_in_when_demand_drops_while_a_replica_is_still_starting() -> None:
    """Demand gone while one of 3 replicas never came up: the count still steps in
    (the old rule waited for every replica to serve, so a stuck start pinned it)."""
    st = AutoscaleState(low_since=0)
    n, st, why = step(3, 0, 2, 50, st)
    assert n == 2 and "3 -> 2" in why
    n, _, _ = step(2, 0, 1, 100, AutoscaleState(low_since=0))
    assert n == 1  # min


def test_scale_in_while_starting_never_goes_below_the_demand() -> None:
    """3 asked for, 1 serving, 0.5 in flight (target 4, low below 1): one replica is
    enough, so it steps in to 2 and then 1, never to 0 with a request in flight."""
    lo0 = dict(lo=0, hi=5, serving=1, policy=POLICY)
    n, _, _ = autoscale(current=3, in_flight=0.5, now=50, state=AutoscaleState(low_since=0), **lo0)  # type: ignore[arg-type]
    assert n == 2
    n, _, _ = autoscale(
        current=1, in_flight=0.5, now=50, state=AutoscaleState(low_since=0), **{**lo0, "serving": 0}
    )  # type: ignore[arg-type]
    assert n == 1


def test_replicas_still_starting_count_toward_a_scale_out() -> None:
    """3 asked for, 1 serving, 10 in flight (target 4): ceil(10/4) = 3 are already on
    their way, so a cold start longer than the cooldown adds none; 14 in flight adds one."""
    st = AutoscaleState()
    n, st, why = step(3, 10, 1, 100, st)
    assert (n, why) == (3, "")
    n, st, why = step(3, 14, 1, 200, st)
    assert n == 4 and "3 -> 4" in why


def test_scale_up_from_zero_on_the_first_request() -> None:
    """With replicas.min 0 and nothing running, one request in flight starts a replica
    (load per serving replica is not defined with none serving)."""
    n, _, why = autoscale(
        current=0, lo=0, hi=5, in_flight=1, serving=0, policy=POLICY, now=0,
        state=AutoscaleState(),
    )  # fmt: skip
    assert n == 1 and "0 -> 1" in why
    n, _, why = autoscale(
        current=0, lo=0, hi=5, in_flight=0, serving=0, policy=POLICY, now=0,
        state=AutoscaleState(),
    )  # fmt: skip
    assert (n, why) == (0, "")
