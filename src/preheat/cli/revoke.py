"""``preheat revoke|unrevoke KEY``: the running fleet's cluster-wide revocation list."""

from __future__ import annotations

import json
from pathlib import Path

import click

from preheat.cli.fleet import _call, _fail, _state_option
from preheat.errors import PreheatError


@click.command()
@click.argument("key")
@click.option("--reason", default="", help="Why (shown in status, the fleet log and errors).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_state_option
def revoke(key: str, reason: str, as_json: bool, state_dir: Path) -> None:
    """Revoke KEY on every node of the running fleet (`preheat up`).

    \b
    KEY is a model revision (as `preheat status` shows it), a snapshot's manifest
    digest, or an image or blob digest (sha256:<hex>). Every node's store removes
    what no replica holds and refuses every new pull of it; variants that run the
    revision roll to the first allowed `model.fallback` of the spec that is not
    revoked, or, with none, keep their serving replicas and are reported Degraded.
    The list survives a restart of `preheat up` (<state>/revocations.json).
    For one store without a fleet: `preheat cache revoke KEY --store DIR`.
    """
    try:
        out = _call(state_dir, "POST", "/revoke", {"key": key, "reason": reason})
    except PreheatError as exc:
        _fail(exc)
        return
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(
            f"revoked {out['key']} on {out['nodes']} node(s); "
            f"{out['removed']} unused snapshot(s) removed"
        )


@click.command()
@click.argument("key")
@_state_option
def unrevoke(key: str, state_dir: Path) -> None:
    """Take KEY off the running fleet's revocation list, on every node."""
    try:
        out = _call(state_dir, "POST", "/unrevoke", {"key": key})
    except PreheatError as exc:
        _fail(exc)
        return
    click.echo("unrevoked" if out["was_revoked"] else f"{key} was not revoked")
