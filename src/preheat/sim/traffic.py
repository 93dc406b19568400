"""Demand over time for the cold-start simulator: synthetic patterns or a user's trace.

Pure (a ``random.Random`` is passed in). Demand is requests in flight per model, the
figure ``control.autoscale`` scales on; it is a step function (constant between
samples) so the simulator and the autoscaler see the same number.

Patterns (``TrafficParams`` holds every parameter; ``capacity`` is the fleet's slots x
``target_in_flight``, the most in-flight requests the fleet serves at its target):

- ``diurnal``: total = capacity x peak_utilization x (trough + (1 - trough) x
  (1 - cos(2 pi t / day)) / 2), trough at t = 0 and the peak half a day later, times a
  multiplicative noise uniform in +-``noise`` per sample. Each model gets its
  popularity share.
- ``burst``: a flat ``burst_base`` x peak, and bursts to the full peak that arrive as a
  Poisson process (mean gap ``burst_every_seconds``) and last ``burst_seconds``: the
  scale-out a launch or a batch job causes.
- ``spot``: ``diurnal`` demand plus node interruptions: a Poisson process over the
  fleet with rate nodes / ``spot_mtbi_seconds``; the simulator picks the node and
  replaces it ``spot_replace_seconds`` later with an empty one.

Every pattern and trace also gets replica crashes (``crash_times``): a Poisson process
with rate slots / ``replica_mtbf_seconds``, drawn after the demand so the demand of a
seed does not change with it; at each the simulator restarts a ready replica in place.

A trace (``trace_from_records``) is JSON lines of ``{"t": s, "model": NAME,
"in_flight": x}`` (one model) or ``{"t": s, "total": x}`` (split by popularity); each
value holds until the next line for that model, and demand is 0 before a model's first.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from preheat.errors import ConfigError
from preheat.sim.coldstart_config import Catalog, TrafficParams

if TYPE_CHECKING:
    import random

__all__ = ["PATTERNS", "Traffic", "crash_times", "pattern_traffic", "trace_from_records"]

PATTERNS = ("diurnal", "burst", "spot")


@dataclass(frozen=True)
class Traffic:
    """In-flight demand per model as a step function, and node interruption times."""

    name: str
    models: tuple[str, ...]
    times: tuple[float, ...]
    #: ``values[i][j]``: demand of ``models[j]`` from ``times[i]`` until ``times[i + 1]``.
    values: tuple[tuple[float, ...], ...]
    interruptions: tuple[float, ...] = ()
    replace_seconds: float = 180.0
    #: Times a ready replica crashes and restarts in place (``crash_times``).
    crashes: tuple[float, ...] = ()

    def at(self, t: float) -> dict[str, float]:
        i = bisect.bisect_right(self.times, t) - 1
        if i < 0:
            return dict.fromkeys(self.models, 0.0)
        return dict(zip(self.models, self.values[i], strict=True))


def _diurnal(p: TrafficParams, t: float) -> float:
    return p.trough + (1 - p.trough) * (1 - math.cos(2 * math.pi * t / p.day_seconds)) / 2


def _poisson(rng: random.Random, mean_gap: float, duration: float) -> list[float]:
    out = []
    t = rng.expovariate(1.0 / mean_gap)
    while t < duration:
        out.append(t)
        t += rng.expovariate(1.0 / mean_gap)
    return out


def crash_times(
    rng: random.Random, *, slots: int, mtbf: float, duration: float
) -> tuple[float, ...]:
    """Crash times over the fleet: Poisson, rate ``slots / mtbf`` (none when mtbf is 0)."""
    if mtbf <= 0:
        return ()
    return tuple(_poisson(rng, mtbf / max(slots, 1), duration))


def pattern_traffic(
    name: str,
    catalog: Catalog,
    *,
    capacity: float,
    nodes: int,
    duration: float,
    rng: random.Random,
) -> Traffic:
    """The demand of pattern ``name`` over ``duration`` seconds (see the module header)."""
    if name not in PATTERNS:
        raise ConfigError(
            f"traffic pattern {name!r} is unknown; choose one of {', '.join(PATTERNS)}"
        )
    p = catalog.traffic
    peak = capacity * p.peak_utilization
    steps = max(1, math.ceil(duration / p.sample_seconds))
    bursts: list[tuple[float, float]] = []
    if name == "burst":
        bursts = [(t, t + p.burst_seconds) for t in _poisson(rng, p.burst_every_seconds, duration)]
    shares = catalog.shares
    times = []
    values = []
    for i in range(steps):
        t = i * p.sample_seconds
        if name == "burst":
            level = 1.0 if any(a <= t < b for a, b in bursts) else p.burst_base
        else:
            level = _diurnal(p, t)
        level *= 1 + rng.uniform(-p.noise, p.noise)
        times.append(t)
        values.append(tuple(peak * level * shares[m.name] for m in catalog.models))
    interruptions: tuple[float, ...] = ()
    if name == "spot":
        interruptions = tuple(_poisson(rng, p.spot_mtbi_seconds / max(nodes, 1), duration))
    return Traffic(
        name=name,
        models=tuple(m.name for m in catalog.models),
        times=tuple(times),
        values=tuple(values),
        interruptions=interruptions,
        replace_seconds=p.spot_replace_seconds,
    )


def _value(where: str, data: Mapping[str, Any], key: str) -> float:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}: {key} = {v!r}; give a number >= 0")
    return float(v)


def trace_from_records(records: Iterable[tuple[int, Any]], catalog: Catalog) -> Traffic:
    """A trace from ``(line number, parsed JSON)`` pairs (see the module header)."""
    names = tuple(m.name for m in catalog.models)
    shares = catalog.shares
    changes: list[tuple[float, int, dict[str, float]]] = []
    for n, data in records:
        where = f"trace line {n}"
        if not isinstance(data, Mapping):
            raise ConfigError(f'{where}: expected a JSON object like {{"t": 0, "total": 40}}')
        extra = sorted(set(data) - {"t", "model", "in_flight", "total"})
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {extra}; use t, model, in_flight or total")
        t = _value(where, data, "t")
        if "total" in data:
            if "model" in data or "in_flight" in data:
                raise ConfigError(f"{where}: give either total or model + in_flight, not both")
            total = _value(where, data, "total")
            changes.append((t, n, {m: total * shares[m] for m in names}))
        else:
            model = data.get("model")
            if model not in names:
                raise ConfigError(
                    f"{where}: model {model!r} is not in the models file ({', '.join(names)})"
                )
            changes.append((t, n, {str(model): _value(where, data, "in_flight")}))
    if not changes:
        raise ConfigError('the trace has no lines; write JSON lines like {"t": 0, "total": 40}')
    changes.sort(key=lambda c: (c[0], c[1]))
    current = dict.fromkeys(names, 0.0)
    times: list[float] = []
    values: list[tuple[float, ...]] = []
    for t, _, update in changes:
        current.update(update)
        row = tuple(current[m] for m in names)
        if times and times[-1] == t:
            values[-1] = row
        else:
            times.append(t)
            values.append(row)
    return Traffic(name="trace", models=names, times=tuple(times), values=tuple(values))
