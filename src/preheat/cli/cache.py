"""``preheat cache``: the node-local model store from the command line.

The group and its inspect/maintain commands (ls, verify, evict, pin, unpin, priority, rm,
manifest); ``pull`` is ``preheat.cli.cache_pull``, ``revoke``/``unrevoke``
``preheat.cli.store_revoke``, the shared options ``preheat.cli.store_options``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from preheat.cli.cache_pull import pull
from preheat.cli.store_options import click_errors, open_store, store_option
from preheat.cli.store_revoke import revoke_command, unrevoke_command
from preheat.config import format_size, parse_size


def _ago(t: float) -> str:
    d = max(0.0, time.time() - t)
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= s:
            return f"{d / s:.0f}{unit} ago"
    return f"{d:.0f}s ago"


@click.group()
def cache() -> None:
    """Node-local model store: content-addressed, verified, resumable fills.

    \b
    Layout under --store DIR:
      blobs/sha256/..     one read-only file per content digest
      snapshots/<digest>/ hard links to blobs: the directory a replica reads
      refs/               what each ref resolved to (audit trail)
      tmp/                partial downloads (a killed pull resumes from here)
      store.db            sqlite: sizes, last use, pins, priorities, leases
    """


@cache.command(name="ls")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls_(store_dir: Path, capacity: str | None, high_watermark: float, as_json: bool) -> None:
    """List snapshots, free space and the next eviction candidates."""
    with click_errors():
        store = open_store(store_dir, capacity, high_watermark)
        snaps = store.snapshots()
        usage = store.usage()
        order = [s.digest for s in store.eviction_candidates()]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "snapshots": [
                        {
                            "manifest_digest": s.digest,
                            "path": str(store.layout.snapshot(s.digest)),
                            "revisions": list(s.revisions),
                            "labels": list(s.labels),
                            "refs": list(s.refs),
                            "size": s.size,
                            "files": s.files,
                            "last_use": s.last_use,
                            "pinned": s.pinned,
                            "leases": list(s.leases),
                            "priority": s.priority,
                        }
                        for s in snaps
                    ],
                    "used": usage.used,
                    "reserved": usage.reserved,
                    "free": usage.free,
                    "capacity": usage.capacity,
                    "eviction_order": order,
                },
                indent=1,
            )
        )
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"preheat store {store.root}")
    for col in ("snapshot", "ref", "size", "last use", "pinned", "leases", "prio", "evict #"):
        table.add_column(col)
    for s in snaps:
        rank = str(order.index(s.digest) + 1) if s.digest in order else "-"
        table.add_row(
            s.digest[:16],
            (s.refs[-1] if s.refs else "")[-60:],
            format_size(s.size),
            _ago(s.last_use),
            "yes" if s.pinned else "",
            ", ".join(s.leases),
            str(s.priority),
            rank,
        )
    con = Console()
    con.print(table)
    cap = format_size(usage.capacity) if usage.capacity else "unset"
    con.print(
        f"used {format_size(usage.used)}, reserved {format_size(usage.reserved)}, "
        f"free for fills {format_size(usage.free)} (capacity {cap}, high watermark "
        f"{usage.high_watermark:.0%}); next eviction: "
        + (", ".join(d[:16] for d in order[:3]) or "nothing evictable")
    )


@cache.command()
@store_option
@click.option(
    "--no-quarantine", is_flag=True, help="Only report; leave corrupt blobs where they are."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def verify(
    store_dir: Path, capacity: str | None, high_watermark: float, no_quarantine: bool, as_json: bool
) -> None:
    """Re-hash every blob; fetch corrupt ones again from their origin and re-link them.

    A blob that cannot be fetched again goes to quarantine/: snapshots using it are
    dropped unless a replica leases them (those are kept, with their holders shown).
    Exits 1 when anything was corrupt or missing, so it can run as a health check.
    """
    with click_errors():
        store = open_store(store_dir, capacity, high_watermark)
        rep = store.verify(quarantine=not no_quarantine)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": rep.ok,
                    "checked": rep.checked,
                    "bytes": rep.bytes,
                    "corrupt": [{"digest": d, "actual": a} for d, a in rep.corrupt],
                    "removed_snapshots": list(rep.removed_snapshots),
                    "missing_snapshots": list(rep.missing_snapshots),
                    "repairs": [
                        {
                            "digest": r.digest,
                            "repaired": r.repaired,
                            "origin": r.origin,
                            "snapshots": list(r.snapshots),
                            "lease_holders": list(r.holders),
                            "reason": r.reason,
                        }
                        for r in rep.repairs
                    ],
                    "seconds": round(rep.seconds, 3),
                }
            )
        )
    else:
        click.echo(f"checked {rep.checked} blobs ({format_size(rep.bytes)}) in {rep.seconds:.2f} s")
        for d, a in rep.corrupt:
            click.echo(f"CORRUPT blob {d}: content hashes to {a}")
        for r in rep.repairs:
            leased = f"; leased by {', '.join(r.holders)}" if r.holders else ""
            if r.repaired:
                click.echo(f"repaired blob {r.digest}: fetched again from {r.origin}{leased}")
            else:
                click.echo(
                    f"UNREPAIRED blob {r.digest} (in quarantine/): {r.reason}{leased}"
                    + ("; leased snapshots kept, pull again to re-link them" if leased else "")
                )
        for d in rep.removed_snapshots:
            click.echo(f"removed snapshot {d} (uses a corrupt or missing blob); pull it again")
    if not rep.ok:
        sys.exit(1)


@cache.command()
@store_option
@click.option("--free", "free", required=True, metavar="SIZE", help="Bytes to free, e.g. 20GiB.")
@click.option("--dry-run", is_flag=True, help="Print the plan only.")
def evict(
    store_dir: Path, capacity: str | None, high_watermark: float, free: str, dry_run: bool
) -> None:
    """Free SIZE bytes: print the eviction plan, then carry it out.

    Lowest priority first, then least recently used; pinned and leased snapshots are
    never chosen. Snapshot directories go first, blobs they alone used last.
    """
    with click_errors():
        store = open_store(store_dir, capacity, high_watermark)
        need = parse_size(free, what="--free")
        plan = store.plan_eviction(need)
        for d in plan.snapshots:
            click.echo(f"evict snapshot {d}")
        click.echo(
            f"plan: {len(plan.snapshots)} snapshots, {len(plan.blobs)} blobs, frees "
            f"{format_size(plan.frees)} of {format_size(need)} asked"
            + ("" if plan.enough else " (NOT enough: the rest is pinned or leased)")
        )
        if dry_run:
            return
        done = store.execute(plan)
        click.echo(f"freed {format_size(done.frees)}")


@cache.command()
@click.argument("snapshot")
@store_option
@click.option("--priority", type=int, default=None, help="Also set the eviction priority.")
def pin(
    snapshot: str,
    store_dir: Path,
    capacity: str | None,
    high_watermark: float,
    priority: int | None,
) -> None:
    """Pin SNAPSHOT (digest, digest prefix or revision) so eviction never takes it."""
    with click_errors():
        store = open_store(store_dir, capacity, high_watermark)
        store.pin(snapshot)
        if priority is not None:
            store.set_priority(snapshot, priority)
    click.echo(f"pinned {snapshot}")


@cache.command()
@click.argument("snapshot")
@store_option
def unpin(snapshot: str, store_dir: Path, capacity: str | None, high_watermark: float) -> None:
    """Unpin SNAPSHOT so eviction may take it again."""
    with click_errors():
        open_store(store_dir, capacity, high_watermark).unpin(snapshot)
    click.echo(f"unpinned {snapshot}")


@cache.command()
@click.argument("snapshot")
@click.argument("value", type=int)
@store_option
def priority(
    snapshot: str, value: int, store_dir: Path, capacity: str | None, high_watermark: float
) -> None:
    """Set SNAPSHOT's eviction priority to VALUE: higher is evicted later (default 0).

    A negative VALUE goes after ``--``: preheat cache priority --store DIR -- 5ab806 -1
    """
    with click_errors():
        open_store(store_dir, capacity, high_watermark).set_priority(snapshot, value)
    click.echo(f"priority of {snapshot} is {value}")


@cache.command()
@click.argument("snapshot")
@store_option
def rm(snapshot: str, store_dir: Path, capacity: str | None, high_watermark: float) -> None:
    """Delete SNAPSHOT and the blobs only it used (refused while it is leased)."""
    with click_errors():
        store = open_store(store_dir, capacity, high_watermark)
        done = store.delete(snapshot if len(snapshot) == 64 else store.snapshot_path(snapshot).name)
    click.echo(f"deleted {snapshot}: freed {format_size(done.frees)}")


@cache.command()
@click.argument(
    "directory", type=click.Path(exists=True, file_okay=False, dir_okay=True, path_type=Path)
)
def manifest(directory: Path) -> None:
    """Hash every file under DIRECTORY and write DIRECTORY/preheat-manifest.json.

    Serve DIRECTORY over HTTP and pull .../preheat-manifest.json.
    """
    from preheat.bench.models import write_http_manifest

    out = write_http_manifest(directory)
    click.echo(str(out))


cache.add_command(pull)
cache.add_command(revoke_command("cache"))
cache.add_command(unrevoke_command("cache"))
