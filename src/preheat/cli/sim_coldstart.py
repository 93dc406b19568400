"""``preheat sim coldstart``: a fleet's replica readiness under a cache policy, on virtual time."""

from __future__ import annotations

import json
from pathlib import Path

import click

from preheat.config import format_size
from preheat.errors import ConfigError
from preheat.sim.coldstart_config import CACHE_POLICIES, WARM_BUDGET
from preheat.sim.traffic import PATTERNS


@click.command()
@click.option("--nodes", type=int, required=True, help="Nodes in the fleet at the start.")
@click.option("--nvme", required=True, help="Local NVMe per node, e.g. 3.5TB or 2TiB.")
@click.option(
    "--models",
    "models_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="YAML of the models (name, size, popularity or zipf; see docs/simulation.md).",
)
@click.option("--pattern", type=click.Choice(PATTERNS), default=None, help="Synthetic demand.")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='JSON lines of demand: {"t": s, "model": NAME, "in_flight": x} or {"t": s, "total": x}.',
)
@click.option(
    "--cache-policy",
    type=click.Choice(CACHE_POLICIES),
    required=True,
    help="none | warm-all | lru | priority (+ pins) | predictive.",
)
@click.option(
    "--origin-bandwidth",
    default="10Gbps",
    show_default=True,
    help="Shared by all downloads from the origin (fair share), e.g. 40Gbps or 5GB/s.",
)
@click.option(
    "--node-bandwidth",
    default="25Gbps",
    show_default=True,
    help="Each node's link, split between its downloads (and its uploads to peers).",
)
@click.option(
    "--registry-bandwidth",
    default="10Gbps",
    show_default=True,
    help="Shared by all image pulls (fair share), for models with image and image_size.",
)
@click.option(
    "--queue-bound",
    type=click.IntRange(0),
    default=None,
    help="Requests that may wait per model while capacity is short; arrivals beyond are "
    "dropped. Default: the models file's queue.max_queued (256).",
)
@click.option(
    "--peers",
    type=click.Choice(["on", "off"]),
    default="off",
    show_default=True,
    help="on: a node that holds a revision serves it to others instead of the origin.",
)
@click.option("--slots", type=int, default=1, show_default=True, help="Replicas per node.")
@click.option(
    "--warm-budget",
    default=WARM_BUDGET,
    show_default=True,
    help="Origin fills at once over the fleet under which a warm-up may start "
    "(control.fanout's budget; replicas' own downloads count, so warm-ups yield the origin "
    "to starts); held warm-ups start when a fill ends. With --peers on a warm-up of a "
    "model some node holds comes from an idle holder, or waits. auto: origin bandwidth / "
    "node bandwidth, rounded up; all: every warm-up at once.",
)
@click.option(
    "--release",
    "releases",
    multiple=True,
    metavar="MODEL@TIME[=SIZE]",
    help="A new revision of MODEL at TIME (e.g. model-01@12h or model-01@12h=650GB; "
    "repeatable), besides the models file's releases: lists. The planner rolls the "
    "model's replicas to it (surge 1, the cache gate, old replicas drained once new ones "
    "serve); its starts are the new_version class.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random draw.")
@click.option(
    "--duration",
    default=None,
    help="Virtual time to simulate, e.g. 72h (default 3 days; 12h for burst; trace end + 1h).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def coldstart(
    nodes: int,
    nvme: str,
    models_path: Path,
    pattern: str | None,
    trace_path: Path | None,
    cache_policy: str,
    origin_bandwidth: str,
    node_bandwidth: str,
    registry_bandwidth: str,
    queue_bound: int | None,
    peers: str,
    slots: int,
    warm_budget: str,
    releases: tuple[str, ...],
    seed: int,
    duration: str | None,
    as_json: bool,
) -> None:
    """Simulate replica cold starts on a fleet with local NVMe, on virtual time.

    The live policy code decides everything: control.autoscale sets each model's
    replica count from its demand, control.plan warms, gates, places and drains,
    store.evict chooses what leaves a full disk, telemetry.classify labels each start.
    Images are pulled from the registry by nodes that lack them, ready replicas crash and
    restart in place (warm_restart), and requests queue while capacity is short.
    A model may get new revisions during the run (releases: in the models file, or
    --release): the planner rolls its replicas (new_version starts), warming policies
    warm the new revision, and superseded copies are deleted once unused.
    Prints readiness (scheduled -> healthy) p50/p95/p99 per event class, the share of
    starts that missed the cache, bytes from the origin, peers and the registry, the time
    some model had fewer ready replicas than its demand needed, and the queue's wait
    p50/p99 and dropped requests.
    """
    from preheat.sim.coldstart import simulate
    from preheat.sim.coldstart_files import prepare

    try:
        setup, rng = prepare(
            nodes=nodes,
            nvme=nvme,
            models=models_path,
            policy=cache_policy,
            pattern=pattern,
            trace=trace_path,
            origin_bandwidth=origin_bandwidth,
            node_bandwidth=node_bandwidth,
            registry_bandwidth=registry_bandwidth,
            queue_bound=queue_bound,
            peers=peers == "on",
            slots=slots,
            warm_budget=warm_budget,
            releases=releases,
            seed=seed,
            duration=duration,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    out = simulate(setup, rng).to_dict()
    if as_json:
        click.echo(json.dumps(out, sort_keys=True))
        return
    hours = out["duration_s"] / 3600
    click.echo(
        f"{out['policy']} on {out['nodes']} nodes x {format_size(out['nvme_bytes'])} NVMe, "
        f"{out['models']} models ({format_size(out['model_bytes'])}), {out['pattern']}, "
        f"{hours:.1f} h, peers {'on' if out['peers'] else 'off'}, seed {out['seed']}"
    )
    click.echo(f"{'event class':<20} {'n':>5} {'p50 s':>9} {'p95 s':>9} {'p99 s':>9} {'miss':>6}")
    for cls, r in out["readiness"].items():
        miss = out["classes"][cls]["miss_share"]
        click.echo(
            f"{cls:<20} {r['n']:>5} {r['p50_s']:>9.1f} {r['p95_s']:>9.1f} {r['p99_s']:>9.1f} "
            f"{miss:>6.1%}"
        )
    click.echo(
        f"starts {out['starts']} ({out['failed_starts']} failed), cache misses "
        f"{out['cache_miss_share']:.1%}; origin {format_size(out['origin_bytes'])}, peers "
        f"{format_size(out['peer_bytes'])}, registry {format_size(out['registry_bytes'])} "
        f"({out['image_pull_starts']} starts pulled their image); warm-ups {out['warmups']}, "
        f"evictions {out['evictions']}, interruptions {out['interruptions']}, crash restarts "
        f"{out['restarts']}"
    )
    if out["releases"]:
        click.echo(
            f"releases {out['releases']}: rollouts finished {out['rollouts_finished']} "
            f"(release to finish p50 {out['rollout_s']['p50_s']:.0f} s, max "
            f"{out['rollout_s']['max_s']:.0f} s; unfinished {out['rollouts_unfinished']}), "
            f"superseded copies deleted {out['revisions_deleted']}, "
            f"{format_size(out['superseded_bytes_at_end'])} of them still on disk at the end"
        )
    click.echo(
        f"unmet demand {out['unmet_demand_s'] / 3600:.2f} h ({out['unmet_demand_share']:.1%} "
        f"of the run), {out['unmet_replica_s'] / 3600:.1f} replica-hours short"
    )
    q = out["queue"]
    click.echo(
        f"requests {q['requests']}: queue wait p50 {q['wait_p50_s']:.1f} s, p99 "
        f"{q['wait_p99_s']:.1f} s, max {q['wait_max_s']:.1f} s; dropped {q['dropped']} "
        f"({q['dropped_share']:.2%}), still queued at the end {q['queued_at_end']}"
    )
