"""`preheat up | status | scale | apply | down | node`: run and steer a local fleet.

`up` runs in the foreground (controller, replicas and router) with a live status table;
the other commands talk to it through its control API (``<state-dir>/control.json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from preheat.config import format_size, parse_size
from preheat.errors import ConfigError, ControlError, PreheatError

STATE_HELP = "Directory of the running fleet's state (control file, logs, events.jsonl)."


def _state_option(f: Any) -> Any:
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path(".preheat"),
        show_default=True,
        envvar="PREHEAT_STATE_DIR",
        help=STATE_HELP,
    )(f)


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, ConfigError) else 1)


# --- rendering ---------------------------------------------------------------------------

_PHASE_STYLE = {
    "ready": "green",
    "starting": "yellow",
    "draining": "magenta",
    "failed": "red",
}
_CACHE_STYLE = {"ready": "green", "warming": "yellow", "failed": "red", "unfit": "red"}


def _short(rev: str | None) -> str:
    if not rev:
        return "-"
    return rev.split(":", 1)[-1][:10]


def render_status(st: dict[str, Any], *, messages: int = 8) -> Group:
    """The status document as rich tables: variants, nodes with cache state, replicas."""
    r = st["router"]
    head = Text.assemble(
        ("endpoint ", "bold"),
        (st["endpoint"], "bold cyan"),
        f"  router {r['url']}  strategy ",
        (r["strategy"], "bold"),
        f" (prefix {r['prefix_length']}, threshold {r['concurrency_threshold']})",
        f"  starts {st['starts']}  restarts {st['restarts']}",
    )
    parts: list[Any] = [head]
    if st.get("resolving"):
        parts.append(Text(f"resolving the model source: {st['resolving']}", style="yellow"))

    vt = Table(title="variants", title_justify="left", expand=False)
    for col in ("variant", "weight", "revision", "stable", "ready/desired", "waiting for"):
        vt.add_column(col)
    for v in st["variants"]:
        vt.add_row(
            v["name"],
            f"{v['weight']:g}",
            _short(v["revision"])
            + (f" ({format_size(v['model_bytes'])})" if v["model_bytes"] else ""),
            _short(v["stable"]) + (" [red](rolled back)[/]" if v["failed"] else ""),
            f"{v['ready']}/{v['replicas']}",
            (f"[red]{v['revoked']}[/] " if v.get("revoked") else "") + (v["waiting"] or ""),
        )
    parts.append(vt)
    for rv in st.get("revocations") or []:
        parts.append(Text(f"revoked {rv['key']}: {rv['reason']}", style="red"))

    nt = Table(title="nodes", title_justify="left")
    for col in ("node", "state", "target", "replicas", "disk", "cache (revision: state)"):
        nt.add_column(col)
    for n in st["nodes"]:
        cache = []
        for rev, c in n["cache"].items():
            text = f"{_short(rev)}: [{_CACHE_STYLE.get(c['state'], 'white')}]{c['state']}[/]"
            if "progress" in c:
                done, total = c["progress"]
                text += f" {100 * done / max(total, 1):.0f}%"
            if c.get("reason"):
                text += f" [dim]({c['reason'][:80]})[/]"
            cache.append(text)
        nt.add_row(
            n["name"],
            "[green]up[/]" if n["up"] else "[red]down[/]",
            "yes" if n["target"] else "",
            f"{n['replicas']}/{n['slots']}",
            f"{format_size(n['used'])} / {format_size(n['capacity'])}",
            "\n".join(cache) or "[dim]empty[/]",
        )
    parts.append(nt)

    rt = Table(title="replicas", title_justify="left")
    for col in ("replica", "node", "revision", "phase", "weights", "restarts", "detail"):
        rt.add_column(col)
    for rep in st["replicas"]:
        style = _PHASE_STYLE.get(rep["phase"], "white")
        rt.add_row(
            rep["id"],
            rep["node"],
            _short(rep["revision"]),
            f"[{style}]{rep['phase']}[/]" + (" [dim](routed)[/]" if rep["routed"] else ""),
            rep["weights"],
            str(rep["restarts"]),
            rep["detail"][:80],
        )
    parts.append(rt)
    if st.get("inventory"):
        from preheat.telemetry.inventory import NodeInventory, inventory_table

        parts.append(inventory_table([NodeInventory.from_dict(n) for n in st["inventory"]]))
    if messages and st["messages"]:
        parts.append(Text("\n".join(st["messages"][-messages:]), style="dim"))
    return Group(*parts)


# --- up ------------------------------------------------------------------------------------


async def _run_up(
    spec_path: Path,
    cluster_path: Path | None,
    state_dir: Path,
    port: int | None,
    live: bool,
) -> None:
    from preheat.control.spec import default_cluster, load_cluster, load_endpoint
    from preheat.runtime.control_api import ControlServer
    from preheat.runtime.local import LocalFleet

    spec = load_endpoint(spec_path)
    state_dir.mkdir(parents=True, exist_ok=True)
    if cluster_path is not None:
        cluster = load_cluster(cluster_path)
    else:
        free = shutil.disk_usage(state_dir).free
        cluster = default_cluster(state_dir.resolve(), capacity=max(free // 2, 1 << 30))
    fleet = LocalFleet(spec, cluster, state_dir.resolve(), router_port=port)
    control = ControlServer(fleet)
    loop = asyncio.get_running_loop()
    stop = control.down
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    console = Console()
    try:
        await fleet.start()
        await control.start()
        if live:
            with Live(render_status(fleet.status()), console=console, refresh_per_second=4) as lv:
                while not stop.is_set():
                    lv.update(render_status(fleet.status()))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.25)
        else:
            seen = 0
            while not stop.is_set():
                fresh = min(fleet.said - seen, len(fleet.messages))
                for m in list(fleet.messages)[len(fleet.messages) - fresh :]:
                    click.echo(m)
                seen = fleet.said
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        click.echo("stopping: replicas, then the router ...", err=True)
        await control.stop()
        await fleet.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        click.echo("stopped every process this fleet started", err=True)


@click.command()
@click.option(
    "-f",
    "--file",
    "spec_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Endpoint spec (YAML): model, engine, replicas, routing, modelCacheConfig.",
)
@click.option(
    "--cluster",
    "cluster_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Cluster file (nodes with store dir, capacity, labels; origin bandwidth). "
    "Default: one local node under the state dir.",
)
@click.option("--port", type=click.IntRange(1, 65535), help="Router port (default: a free one).")
@click.option(
    "--live/--no-live",
    default=None,
    help="Live status table (default: on a terminal) or plain log lines.",
)
@_state_option
def up(
    spec_path: Path, cluster_path: Path | None, port: int | None, live: bool | None, state_dir: Path
) -> None:
    """Run an endpoint in the foreground: warm caches, start replicas and the router.

    \b
    Replicas are created once modelCacheConfig.weights.minReady target nodes hold the
    model; they go to warm nodes first. Ctrl-C stops every process it started.
    Steer it from another terminal with `preheat status | scale | apply | node | down`.

    \b
    Example:
      preheat up -f examples/endpoint.yaml --cluster examples/cluster.yaml
      curl -s localhost:PORT/v1/completions -d '{"prompt": "Hi", "max_tokens": 8}'
    """
    from preheat.control.spec import load_endpoint

    try:
        load_endpoint(spec_path)  # invalid spec: an error naming the field, nothing started
        cf = state_dir / "control.json"
        if cf.exists():
            info = json.loads(cf.read_text())
            pid = int(info.get("pid", 0))
            if pid and _alive(pid):
                raise ControlError(
                    f"a `preheat up` (pid {pid}) already runs in {state_dir}; "
                    "stop it with `preheat down` or use another --state-dir"
                )
        use_live = sys.stdout.isatty() if live is None else live
        asyncio.run(_run_up(spec_path, cluster_path, state_dir, port, use_live))
    except (PreheatError, OSError) as exc:
        _fail(exc)


def _alive(pid: int) -> bool:
    """The process exists and has not exited (an unreaped zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# --- steering commands ---------------------------------------------------------------------


def _call(state_dir: Path, method: str, path: str, body: Any = None) -> Any:
    from preheat.runtime.control_api import call

    return call(state_dir, method, path, body)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@_state_option
def status(as_json: bool, state_dir: Path) -> None:
    """Show the running fleet: variants, nodes and their caches, replicas, router, and
    each node's cache inventory (revisions, bytes, last use, leased by, pinned, priority,
    free space, next eviction candidates, last warm-up failure).

    \b
    With --json the same document; the inventory is under "inventory", one object per
    node (see docs/telemetry.md).
    """
    try:
        st = _call(state_dir, "GET", "/status")
    except PreheatError as exc:
        _fail(exc)
        return
    if as_json:
        click.echo(json.dumps(st, indent=1))
    else:
        Console().print(render_status(st, messages=12))


@click.command()
@click.argument("replicas", type=click.IntRange(0))
@click.option("--variant", help="Variant to scale (needed when the endpoint has several).")
@_state_option
def scale(replicas: int, variant: str | None, state_dir: Path) -> None:
    """Set the replica count (within replicas.min..max); new replicas go to warm nodes."""
    try:
        _call(state_dir, "POST", "/scale", {"replicas": replicas, "variant": variant})
    except PreheatError as exc:
        _fail(exc)
        return
    click.echo(f"scaling to {replicas}")


@click.command()
@click.option(
    "-f",
    "--file",
    "spec_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The changed endpoint spec.",
)
@_state_option
def apply(spec_path: Path, state_dir: Path) -> None:
    """Change the running endpoint's spec (model revision, replicas, routing, cache).

    A new model revision is warmed on the target nodes first, then replicas roll (new
    one healthy before an old one drains), then the old revision's cache is deleted.
    An invalid spec is rejected and the running endpoint stays as it is.
    """
    import yaml

    from preheat.control.spec import load_endpoint

    try:
        load_endpoint(spec_path)
        doc = yaml.safe_load(spec_path.read_text())
        _call(state_dir, "POST", "/apply", {"spec": doc, "origin": str(spec_path)})
    except (PreheatError, OSError) as exc:
        _fail(exc)
        return
    click.echo(f"applied {spec_path}")


@click.command()
@_state_option
def down(state_dir: Path) -> None:
    """Stop the running `preheat up` (replicas, router) and wait until it is gone."""
    import time

    try:
        info = json.loads((state_dir / "control.json").read_text())
        _call(state_dir, "POST", "/down")
    except (PreheatError, OSError, ValueError) as exc:
        _fail(exc if isinstance(exc, PreheatError) else ControlError(f"no running fleet: {exc}"))
        return
    pid = int(info.get("pid", 0))
    deadline = time.monotonic() + 120
    while pid and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    click.echo("stopped")


@click.group()
def node() -> None:
    """Simulate node loss and add nodes to the running fleet."""


@node.command("fail")
@click.argument("name")
@_state_option
def node_fail(name: str, state_dir: Path) -> None:
    """Lose node NAME: its replicas die and are replaced on other nodes."""
    try:
        _call(state_dir, "POST", f"/nodes/{name}/fail")
    except PreheatError as exc:
        _fail(exc)
        return
    click.echo(f"node {name} failed")


@node.command("add")
@click.argument("name")
@click.option("--capacity", help="Disk budget, e.g. 20GiB (default: like the first node).")
@click.option("--label", "labels", multiple=True, help="A label KEY=VALUE (repeatable).")
@click.option("--slots", type=click.IntRange(1), help="Replicas the node can run.")
@_state_option
def node_add(
    name: str, capacity: str | None, labels: tuple[str, ...], slots: int | None, state_dir: Path
) -> None:
    """Add node NAME (or bring a failed one back); target nodes are warmed."""
    try:
        body: dict[str, Any] = {}
        if capacity:
            parse_size(capacity, what="--capacity")
            body["capacity"] = capacity
        if labels:
            pairs = {}
            for item in labels:
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise ConfigError(f"--label {item!r} is not KEY=VALUE")
                pairs[key] = value
            body["labels"] = pairs
        if slots:
            body["slots"] = slots
        _call(state_dir, "POST", f"/nodes/{name}/add", body)
    except PreheatError as exc:
        _fail(exc)
        return
    click.echo(f"node {name} added")
