"""``preheat report``: start-time percentiles in the terminal and an HTML report on disk."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

from preheat.errors import ConfigError


@click.command()
@click.option(
    "--events",
    "events_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("events.jsonl"),
    show_default=True,
    help="JSONL file of start records (what `preheat up` and `preheat demo` write).",
)
@click.option(
    "--decisions",
    "decisions_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSONL file of routing decisions (router-side samples); adds the routing plots.",
)
@click.option(
    "--inventory",
    "inventory_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON cache inventory (as written by the fleet); adds the per-node inventory.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("report"),
    show_default=True,
    help="Directory for index.html and its PNG plots (created if missing).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the percentiles as JSON instead.")
def report(
    events_path: Path,
    decisions_path: Path | None,
    inventory_path: Path | None,
    out_dir: Path,
    as_json: bool,
) -> None:
    """Summarise replica start times and write an HTML report.

    Prints p50/p95/p99 of every start stage per event class (warm_restart,
    cold_pod_warm_node, new_node, new_version, node_loss_recovery, scale_out), never one
    blended mean, and writes OUT/index.html with plots: readiness CDF per class, stage
    breakdown, cache hit ratio over time, and (with --decisions) per-instance share and
    KV hit rate of routed requests. The page is self-contained: open it from disk.

    \b
    Example:
      preheat report --events out/events.jsonl --decisions out/decisions.jsonl --out out/report
    """
    from preheat.telemetry.events import StartRecord, read_jsonl
    from preheat.telemetry.inventory import inventory_from_json
    from preheat.telemetry.report import stage_table_rich, write_report
    from preheat.telemetry.stats import stage_table

    console = Console(stderr=as_json)
    try:
        if not events_path.is_file():
            raise ConfigError(
                f"no events file at {str(events_path)!r}; pass --events FILE "
                "(`preheat demo --out DIR` writes DIR/events.jsonl)"
            )
        if decisions_path is not None and not decisions_path.is_file():
            raise ConfigError(
                f"no decisions file at {str(decisions_path)!r}; pass the router's decision "
                "JSONL, or leave --decisions out"
            )
        result = read_jsonl(events_path, StartRecord.from_dict)
        inventory = None
        if inventory_path is not None:
            if not inventory_path.is_file():
                raise ConfigError(
                    f"inventory file {str(inventory_path)!r} does not exist; give the JSON "
                    "file the fleet wrote, or leave --inventory out"
                )
            try:
                inventory = inventory_from_json(inventory_path.read_text())
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"inventory file {str(inventory_path)!r} is not a cache inventory: {exc}"
                ) from None
        with console.status(f"writing plots to {out_dir} ..."):
            index = write_report(
                result.records,
                out_dir,
                route_decisions_path=decisions_path,
                inventory=inventory,
            )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    records = result.records
    if as_json:
        rows = [
            {
                "event_class": r.event_class.value,
                "stage": r.stage,
                "n": r.seconds.n,
                "p50": r.seconds.p50,
                "p95": r.seconds.p95,
                "p99": r.seconds.p99,
            }
            for r in stage_table(records)
        ]
        click.echo(
            json.dumps(
                {
                    "records": len(records),
                    "skipped_lines": result.skipped,
                    "stages": rows,
                    "report": str(index),
                },
                indent=2,
            )
        )
        return
    if records:
        console.print(stage_table_rich(records))
    else:
        console.print(f"[yellow]{events_path} holds no start records[/yellow]")
    if result.skipped:
        console.print(
            f"[yellow]skipped {result.skipped} torn line(s) in {events_path} "
            "(a writer was killed mid-line)[/yellow]"
        )
    console.print(f"report: {index}")
