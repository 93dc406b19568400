"""Reading the cold-start simulator's inputs from files (the edge; the rest is pure).

``load_catalog``: the models YAML (its shape in ``coldstart_config``); ``load_trace``:
a demand trace in JSON lines (its shape in ``traffic``); ``prepare``: a whole setup from
the CLI's values. Both turn every problem into a
``ConfigError`` naming the file, the line where there is one, and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import yaml

from preheat.config import parse_size
from preheat.errors import ConfigError
from preheat.sim.coldstart import ColdStartSetup
from preheat.sim.coldstart_catalog import catalog_from_dict
from preheat.sim.coldstart_config import (
    WARM_BUDGET,
    Catalog,
    parse_bandwidth,
    parse_duration,
    parse_warm_budget,
)
from preheat.sim.coldstart_releases import with_releases
from preheat.sim.traffic import Traffic, crash_times, pattern_traffic, trace_from_records

__all__ = ["load_catalog", "load_trace", "prepare"]


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the {what} {path} is not UTF-8 text") from exc


def load_catalog(path: Path) -> Catalog:
    text = _read(path, "models file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    try:
        return catalog_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def load_trace(path: Path, catalog: Catalog) -> Traffic:
    records = []
    for n, line in enumerate(_read(path, "trace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} line {n} is not JSON: {exc.msg}") from exc
    try:
        return trace_from_records(records, catalog)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def prepare(
    *,
    nodes: int,
    nvme: str | int,
    models: Path | Catalog,
    policy: str,
    pattern: str | None = None,
    trace: Path | None = None,
    origin_bandwidth: str | float = "10Gbps",
    node_bandwidth: str | float = "25Gbps",
    registry_bandwidth: str | float = "10Gbps",
    queue_bound: int | None = None,
    peers: bool = False,
    slots: int = 1,
    seed: int = 0,
    duration: str | float | None = None,
    warm_budget: int | str | None = WARM_BUDGET,
    releases: tuple[str, ...] | list[str] = (),
) -> tuple[ColdStartSetup, random.Random]:
    """A ready-to-run setup from user-facing values (what ``preheat sim coldstart`` takes).

    ``duration`` defaults to three days for ``diurnal``/``spot`` (one day is a single
    ramp up and down: nothing is ever re-used), 12 h for ``burst``, and the trace's last
    time plus an hour for a trace."""
    if (pattern is None) == (trace is None):
        raise ConfigError("give exactly one of --pattern NAME or --trace FILE")
    catalog = models if isinstance(models, Catalog) else load_catalog(models)
    if releases:
        catalog = with_releases(catalog, tuple(releases))
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes} must be at least 1")
    if slots < 1:
        raise ConfigError(f"--slots {slots} must be at least 1")
    nvme_bytes = parse_size(nvme, what="--nvme")
    rng = random.Random(seed)
    if trace is not None:
        traffic = load_trace(trace, catalog)
        span = traffic.times[-1] + 3600.0
    else:
        span = 12 * 3600.0 if pattern == "burst" else 3 * 86400.0
    seconds = span if duration is None else parse_duration(duration, what="--duration")
    if trace is None:
        assert pattern is not None
        traffic = pattern_traffic(
            pattern,
            catalog,
            capacity=nodes * slots * catalog.autoscaling.target_in_flight,
            nodes=nodes,
            duration=seconds,
            rng=rng,
        )
    mtbf = catalog.traffic.replica_mtbf_seconds
    crashes = crash_times(rng, slots=nodes * slots, mtbf=mtbf, duration=seconds)
    traffic = dataclasses.replace(traffic, crashes=crashes)
    if queue_bound is not None:
        if queue_bound < 0:
            raise ConfigError(f"--queue-bound {queue_bound} must be 0 or more requests")
        queue = dataclasses.replace(catalog.queue, max_queued=queue_bound)
        catalog = dataclasses.replace(catalog, queue=queue)
    origin_bw = parse_bandwidth(origin_bandwidth, what="--origin-bandwidth")
    node_bw = parse_bandwidth(node_bandwidth, what="--node-bandwidth")
    setup = ColdStartSetup(
        nodes=nodes,
        nvme=nvme_bytes,
        catalog=catalog,
        traffic=traffic,
        policy=policy,
        duration=seconds,
        origin_bandwidth=origin_bw,
        node_bandwidth=node_bw,
        registry_bandwidth=parse_bandwidth(registry_bandwidth, what="--registry-bandwidth"),
        peers=peers,
        slots=slots,
        seed=seed,
        warm_budget=parse_warm_budget(
            warm_budget, origin_bandwidth=origin_bw, node_bandwidth=node_bw
        ),
    )
    return setup, rng
