"""``preheat sim``: the fleet simulator on virtual time, with the live policy code."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from preheat.bench.workloads import WORKLOADS
from preheat.errors import ConfigError
from preheat.router.policies import POLICIES, PolicyParams
from preheat.router.policies.base import PLACEMENTS
from preheat.sim.routing import RoutingConfig, SimItem, simulate_routing
from preheat.sim.trace import parse_trace
from preheat.timing import PROFILES

#: The router's own defaults (``PolicyParams``), so a simulated fleet routes as a live
#: one does unless told otherwise.
ROUTER_DEFAULTS = PolicyParams()


@click.group()
def sim() -> None:
    """Simulate a fleet on virtual time with the live system's own code.

    The router's policies, the engine's scheduler and KV cache and the timing profiles
    run unchanged; only the clock is virtual, so hours of traffic over hundreds of
    instances take seconds.
    """


def workload_args(pairs: tuple[str, ...]) -> dict[str, int | float]:
    """``KEY=VALUE`` workload parameters (numbers), e.g. ``families=300``."""
    out: dict[str, int | float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            out[key] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:
            sep = ""
        if not sep or not key.isidentifier():
            raise ConfigError(f"--set {pair!r}: give KEY=NUMBER, e.g. --set families=300")
    return out


def load_items(
    workload: str | None,
    trace: Path | None,
    requests: int | None,
    seed: int,
    params: dict[str, int | float] | None = None,
) -> list[SimItem]:
    """The requests of a named workload (``requests`` of them) or of a JSONL trace."""
    if (workload is None) == (trace is None):
        raise ConfigError("give exactly one of --workload NAME or --trace FILE")
    if trace is not None:
        try:
            text = trace.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the trace {trace}: {exc.strerror}") from exc
        items = parse_trace(text.splitlines(), where=str(trace))
        return items[:requests] if requests else items
    assert workload is not None
    make = WORKLOADS.get(workload)
    if make is None:
        raise ConfigError(
            f"workload {workload!r} is unknown; choose one of {', '.join(sorted(WORKLOADS))}"
        )
    try:
        work = make(requests or 1000, seed=seed, **(params or {}))
    except TypeError as exc:
        raise ConfigError(f"workload {workload!r}: {exc}; see bench/workloads.py") from exc
    return [SimItem(w.request_id, w.path, w.body, w.after) for w in work]


@sim.command()
@click.option("--instances", type=click.IntRange(1), required=True, help="Engines in the fleet.")
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    required=True,
    help="Engine timing profile (hardware x model; preheat/timing.py).",
)
@click.option(
    "--kv-blocks",
    type=click.IntRange(1),
    default=None,
    help="KV cache per engine in 16-token blocks (default: the profile's capacity).",
)
@click.option("--policy", type=click.Choice(sorted(POLICIES)), required=True, help="Router policy.")
@click.option(
    "--placement",
    type=click.Choice(PLACEMENTS),
    default=ROUTER_DEFAULTS.placement,
    show_default=True,
    help="prefix_aware placement (router/policies/prefix_aware.py); the router's default.",
)
@click.option("--workload", default=None, help=f"Seeded workload: {', '.join(sorted(WORKLOADS))}.")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="A workload parameter (bench/workloads.py), e.g. --set families=300; repeatable.",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help='JSONL: an OpenAI body per line, or {"t": seconds, "body": {...}}.',
)
@click.option(
    "--requests",
    type=click.IntRange(1),
    default=None,
    help="Requests to draw from the workload (default 1000) or to take from the trace.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=None,
    help="Closed loop: clients that each send the next request when their answer ends.",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Open loop: Poisson arrivals at this many requests/s.",
)
@click.option(
    "--prefix-length",
    type=int,
    default=ROUTER_DEFAULTS.prefix_length,
    show_default=True,
    help="Key chars.",
)
@click.option(
    "--threshold",
    type=int,
    default=ROUTER_DEFAULTS.concurrency_threshold,
    show_default=True,
    help="In-flight cap per instance.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Workload and policy seed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def routing(
    instances: int,
    profile: str,
    kv_blocks: int | None,
    policy: str,
    placement: str,
    workload: str | None,
    settings: tuple[str, ...],
    trace: Path | None,
    requests: int | None,
    concurrency: int | None,
    rate: float | None,
    prefix_length: int,
    threshold: int,
    seed: int,
    as_json: bool,
) -> None:
    """Route a workload or a trace over N simulated engines and report what the engines saw.

    TTFT and end-to-end percentiles, output tokens/s, the engine-side KV hit rate (prompt
    tokens found in the prefix cache over tokens looked up, as vLLM counts them), the
    per-instance request shares and the policy's decisions by outcome. A trace whose lines
    carry "t" is replayed at those times unless --concurrency or --rate is given; one
    without needs --concurrency.
    """
    try:
        items = load_items(workload, trace, requests, seed, workload_args(settings))
        if concurrency is None and rate is None and items[0].t is None:
            raise ConfigError("give --concurrency C (closed loop) or --rate R (open loop)")
        cfg = RoutingConfig(
            instances=instances,
            profile=PROFILES[profile],
            policy=policy,
            params=PolicyParams(
                prefix_length=prefix_length, concurrency_threshold=threshold, placement=placement
            ),
            kv_blocks=kv_blocks,
            concurrency=concurrency,
            rate=rate,
        )
        result = simulate_routing(
            items,
            cfg,
            policy_rng=random.Random(seed),
            arrival_rng=random.Random(seed + 1),
        )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    out = result.summary()
    if as_json:
        click.echo(json.dumps(out))
        return
    _print(out)


def _print(out: dict[str, Any]) -> None:
    t = Table(
        title=f"{out['requests']} requests over {out['instances']} x {out['profile']}, "
        f"{out['policy']} ({out['virtual_s']:.1f} s virtual)"
    )
    t.add_column("metric")
    t.add_column("value", justify="right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms"):
        t.add_row(k, ms(out[k]))
    t.add_row("output tokens/s", f"{out['output_tokens_per_s']:.0f}")
    t.add_row("KV hit rate", f"{out['kv_hit_rate']:.3f}")
    t.add_row("max share / mean", f"{out['max_share_over_mean']:.2f}")
    t.add_row("decisions", ", ".join(f"{k} {v}" for k, v in out["decisions"].items()))
    t.add_row("errors", str(out["errors"]))
    Console().print(t)


def _coldstart() -> None:
    # The cold-start simulator's command lives in its own module (one concept each).
    from preheat.cli.sim_coldstart import coldstart

    sim.add_command(coldstart)


_coldstart()
