"""``preheat cache``: the node-local model store from the command line."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from preheat.config import format_size, parse_size
from preheat.errors import PreheatError

STORE_HELP = "Store directory (created if missing); also read from $PREHEAT_STORE."


def _store_option(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--capacity",
        default=None,
        metavar="SIZE",
        help="Most the store may hold, e.g. 200GiB; fills stay under SIZE x --high-watermark. "
        "Default: bounded only by free disk space.",
    )(f)
    f = click.option(
        "--high-watermark",
        type=click.FloatRange(0.01, 1.0),
        default=0.9,
        show_default=True,
        help="Fraction of --capacity that fills may use before eviction kicks in.",
    )(f)
    return click.option(
        "--store",
        "store_dir",
        required=True,
        envvar="PREHEAT_STORE",
        type=click.Path(file_okay=False, path_type=Path),
        help=STORE_HELP,
    )(f)


def _open(store_dir: Path, capacity: str | None, high_watermark: float) -> Any:
    from preheat.store import NodeStore

    cap = parse_size(capacity, what="--capacity") if capacity else None
    return NodeStore(store_dir, capacity=cap, high_watermark=high_watermark)


@contextmanager
def _errors() -> Iterator[None]:
    """Preheat errors become one clear line and exit code 1 (no traceback)."""
    try:
        yield
    except PreheatError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


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


@cache.command()
@click.argument("source")
@_store_option
@click.option(
    "--endpoint-url",
    default=None,
    help="S3 API endpoint for s3:// sources (e.g. http://127.0.0.1:9000); the Hub for hf:// "
    "(default $HF_ENDPOINT, else https://huggingface.co).",
)
@click.option(
    "--include",
    multiple=True,
    metavar="GLOB",
    help="hf:// only: pull just the files matching GLOB (repeatable), like "
    "`huggingface-cli download --include`.",
)
@click.option(
    "--exclude",
    multiple=True,
    metavar="GLOB",
    help="hf:// only: leave out the files matching GLOB (repeatable); 'dir/' means all under it.",
)
@click.option(
    "--connections",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="Parallel ranged requests over all files.",
)
@click.option(
    "--rate-limit",
    default=None,
    metavar="SIZE",
    help="Cap on bytes per second over all connections, e.g. 100MB (simulates a remote origin).",
)
@click.option(
    "--chunk-size",
    default="32MiB",
    show_default=True,
    metavar="SIZE",
    help="Bytes per ranged request; a resumed pull skips the chunks it finished.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the result.")
def pull(
    source: str,
    store_dir: Path,
    capacity: str | None,
    high_watermark: float,
    endpoint_url: str | None,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    connections: int,
    rate_limit: str | None,
    chunk_size: str,
    as_json: bool,
) -> None:
    """Fetch SOURCE into the store and print the snapshot directory.

    \b
    SOURCE is one of:
      file:///abs/dir                          a directory tree on this machine
      https://host/path/preheat-manifest.json  files listed (path, size, sha256) by a manifest
      https://host/path/file.bin               a single file
      s3://bucket/prefix                       every object under the prefix (--endpoint-url)
      hf://ORG/NAME[@REVISION]                 a Hugging Face Hub model at a branch, tag or
                                               commit (default main); $HF_ENDPOINT picks a
                                               mirror, $HF_TOKEN (or `hf auth login`'s token
                                               file) opens private and gated repos
      oci://registry/repo:tag                  a CNCF ModelPack artifact (or @sha256:…);
                                               credentials from docker's config.json

    SOURCE is resolved afresh to an immutable revision; only blobs the store lacks are
    fetched, every byte is checked against its sha256, and the snapshot appears
    atomically. A pull that was killed resumes where it stopped.

    \b
    Example:
      preheat cache pull https://models.example/llama/preheat-manifest.json --store /srv/preheat
    """
    with _errors():
        source = _with_filters(source, include, exclude)
        store = _open(store_dir, capacity, high_watermark)
        rate = float(parse_size(rate_limit, what="--rate-limit")) if rate_limit else None
        kwargs: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "rate_limit": rate,
            "connections": connections,
            "chunk": parse_size(chunk_size, what="--chunk-size"),
        }
        if not as_json and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                transient=True,
            ) as bar:
                task = bar.add_task("pull", total=None)

                def progress(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                result = store.pull(source, progress=progress, **kwargs)
        else:
            result = store.pull(source, **kwargs)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    rate_s = format_size(result.bytes_fetched / result.seconds) if result.seconds > 0 else "-"
    click.echo(
        f"revision {result.revision}: fetched {format_size(result.bytes_fetched)}, "
        f"reused {format_size(result.bytes_reused)}"
        + (f", resumed {format_size(result.bytes_resumed)}" if result.bytes_resumed else "")
        + f" in {result.seconds:.2f} s ({rate_s}/s)",
        err=True,
    )
    click.echo(str(result.snapshot))


def _with_filters(source: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> str:
    """``source`` with --include/--exclude written into an hf:// ref's ``#`` filters."""
    if not include and not exclude:
        return source
    if not source.startswith("hf://"):
        from preheat.errors import ConfigError

        raise ConfigError(
            f"--include/--exclude only apply to hf:// sources, not {source!r}; for other "
            "sources publish only the files you want"
        )
    from urllib.parse import quote

    items = [
        f"{k}={quote(v, safe='*?[]!/._-')}"
        for k, vs in (("include", include), ("exclude", exclude))
        for v in vs
    ]
    head, _, fragment = source.partition("#")
    return f"{head}#{'&'.join(filter(None, [fragment, *items]))}"


@cache.command(name="ls")
@_store_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls_(store_dir: Path, capacity: str | None, high_watermark: float, as_json: bool) -> None:
    """List snapshots, free space and the next eviction candidates."""
    with _errors():
        store = _open(store_dir, capacity, high_watermark)
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
@_store_option
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
    with _errors():
        store = _open(store_dir, capacity, high_watermark)
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
@_store_option
@click.option("--free", "free", required=True, metavar="SIZE", help="Bytes to free, e.g. 20GiB.")
@click.option("--dry-run", is_flag=True, help="Print the plan only.")
def evict(
    store_dir: Path, capacity: str | None, high_watermark: float, free: str, dry_run: bool
) -> None:
    """Free SIZE bytes: print the eviction plan, then carry it out.

    Lowest priority first, then least recently used; pinned and leased snapshots are
    never chosen. Snapshot directories go first, blobs they alone used last.
    """
    with _errors():
        store = _open(store_dir, capacity, high_watermark)
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
@_store_option
@click.option("--priority", type=int, default=None, help="Also set the eviction priority.")
def pin(
    snapshot: str,
    store_dir: Path,
    capacity: str | None,
    high_watermark: float,
    priority: int | None,
) -> None:
    """Pin SNAPSHOT (digest, digest prefix or revision) so eviction never takes it."""
    with _errors():
        store = _open(store_dir, capacity, high_watermark)
        store.pin(snapshot)
        if priority is not None:
            store.set_priority(snapshot, priority)
    click.echo(f"pinned {snapshot}")


@cache.command()
@click.argument("snapshot")
@_store_option
def unpin(snapshot: str, store_dir: Path, capacity: str | None, high_watermark: float) -> None:
    """Unpin SNAPSHOT so eviction may take it again."""
    with _errors():
        _open(store_dir, capacity, high_watermark).unpin(snapshot)
    click.echo(f"unpinned {snapshot}")


@cache.command()
@click.argument("snapshot")
@click.argument("value", type=int)
@_store_option
def priority(
    snapshot: str, value: int, store_dir: Path, capacity: str | None, high_watermark: float
) -> None:
    """Set SNAPSHOT's eviction priority to VALUE: higher is evicted later (default 0).

    A negative VALUE goes after ``--``: preheat cache priority --store DIR -- 5ab806 -1
    """
    with _errors():
        _open(store_dir, capacity, high_watermark).set_priority(snapshot, value)
    click.echo(f"priority of {snapshot} is {value}")


@cache.command()
@click.argument("snapshot")
@_store_option
def rm(snapshot: str, store_dir: Path, capacity: str | None, high_watermark: float) -> None:
    """Delete SNAPSHOT and the blobs only it used (refused while it is leased)."""
    with _errors():
        store = _open(store_dir, capacity, high_watermark)
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


# One store-level revocation list serves images and model revisions (docs/images.md);
# ``preheat image revoke|unrevoke`` are the same commands.
def revoke_command(what: str) -> click.Command:
    """``revoke KEY``: the store-level revocation list (also ``preheat cache revoke``)."""

    @click.command(name="revoke")
    @click.argument("key", metavar="DIGEST" if what == "image" else "REVISION")
    @_store_option
    @click.option("--reason", default="", help="Why (kept with the entry, shown in refusals).")
    @click.option("--json", "as_json", is_flag=True, help="Print what was removed as JSON.")
    def revoke(
        key: str,
        store_dir: Path,
        capacity: str | None,
        high_watermark: float,
        reason: str,
        as_json: bool,
    ) -> None:
        """Revoke KEY (an image, layer, blob or snapshot digest, or a model revision):
        remove it from the store and refuse every new pull of it until `unrevoke`.
        Snapshots a replica or endpoint still holds are kept for it and listed."""
        from preheat.store.revoke import revoke as do_revoke

        with _errors():
            store = _open(store_dir, capacity, high_watermark)
            rep = do_revoke(store._db, store._space, key, reason)
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "key": rep.key,
                        "removed": list(rep.removed),
                        "kept": [{"snapshot": s, "holders": list(h)} for s, h in rep.kept],
                        "blobs": list(rep.blobs),
                    }
                )
            )
            return
        click.echo(
            f"revoked {rep.key}: removed {len(rep.removed)} snapshot(s), {len(rep.blobs)} blob(s)"
        )
        for s, holders in rep.kept:
            click.echo(f"kept {s[:16]} for {', '.join(holders)} (release them to remove it)")

    revoke.help = (revoke.help or "").replace("KEY", "DIGEST" if what == "image" else "REVISION")
    return revoke


def unrevoke_command(what: str) -> click.Command:
    @click.command(name="unrevoke")
    @click.argument("key", metavar="DIGEST" if what == "image" else "REVISION")
    @_store_option
    def unrevoke(key: str, store_dir: Path, capacity: str | None, high_watermark: float) -> None:
        """Take KEY off the store's revocation list: pulls of it are allowed again."""
        from preheat.store.revoke import unrevoke as do_unrevoke

        with _errors():
            store = _open(store_dir, capacity, high_watermark)
            was = do_unrevoke(store._db, key)
        click.echo("unrevoked" if was else f"{key} was not revoked")

    return unrevoke


cache.add_command(revoke_command("cache"))
cache.add_command(unrevoke_command("cache"))
