"""``preheat cache pull``: fetch a source into the node-local model store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from preheat.cli.store_options import click_errors, open_store, store_option
from preheat.config import format_size, parse_size

__all__ = ["pull"]


@click.command()
@click.argument("source")
@store_option
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
    with click_errors():
        source = _with_filters(source, include, exclude)
        store = open_store(store_dir, capacity, high_watermark)
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
