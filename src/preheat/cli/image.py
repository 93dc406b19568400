"""``preheat image``: the node image cache (pull by digest, list, remove, revoke, serve)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import click

from preheat.cli.store_options import click_errors, open_store, store_option
from preheat.cli.store_revoke import revoke_command, unrevoke_command
from preheat.config import format_size


def _cache(
    store_dir: Path, capacity: str | None, high_watermark: float, docker_config: Path | None = None
) -> Any:
    from preheat.images import ImageCache

    return ImageCache(open_store(store_dir, capacity, high_watermark), docker_config=docker_config)


def _with_bar(run: Any) -> Any:
    """``run(progress)`` with a rich progress bar on stderr (``run(None)`` off a terminal)."""
    if not sys.stderr.isatty():
        return run(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("pull", total=None)
        return run(lambda done, total: bar.update(task, completed=done, total=total))


@click.group()
def image() -> None:
    """Container images in the node store: layers stored once per digest, shared with
    other images and models, an OCI image layout per image, never evicted while an
    endpoint references it. See docs/images.md."""


@image.command()
@click.argument("ref")
@store_option
@click.option(
    "--platform",
    default=None,
    help="os/arch[/variant] to take from a multi-platform image (default: this node's).",
)
@click.option(
    "--connections",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="Parallel ranged requests.",
)
@click.option(
    "--docker-config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="config.json with registry credentials (default $DOCKER_CONFIG/config.json, ~/.docker/config.json).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (digest, bytes_fetched, bytes_reused, layers, seconds, ...).",
)
def pull(
    ref: str,
    store_dir: Path,
    capacity: str | None,
    high_watermark: float,
    platform: str | None,
    connections: int,
    docker_config: Path | None,
    as_json: bool,
) -> None:
    """Pull image REF into the store and print its OCI layout directory.

    \b
    REF is [HOST[:PORT]/]REPO[:TAG][@sha256:DIGEST]; 127.0.0.1 and localhost registries
    are plain HTTP, all others HTTPS. The tag is resolved once; layers the store has are
    not fetched again; every blob is checked against its digest.

    \b
    Example:
      preheat image pull 127.0.0.1:5000/team/app:v1 --store /srv/preheat --json
    """
    from preheat.images import parse_platform

    with click_errors():
        cache = _cache(store_dir, capacity, high_watermark, docker_config)
        plat = parse_platform(platform) if platform else None
        result = (
            _with_bar(
                lambda progress: cache.pull(
                    ref, platform=plat, progress=progress, connections=connections
                )
            )
            if not as_json
            else cache.pull(ref, platform=plat, connections=connections)
        )
    if as_json:
        click.echo(json.dumps(result.to_json()))
        return
    click.echo(
        f"{result.name}@{result.digest}: {result.layers} layers, fetched "
        f"{format_size(result.bytes_fetched)}, reused {format_size(result.bytes_reused)} "
        f"in {result.seconds:.2f} s",
        err=True,
    )
    click.echo(str(result.view))


@image.command(name="ls")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls_(store_dir: Path, capacity: str | None, high_watermark: float, as_json: bool) -> None:
    """List the images in the store (most recently pulled first)."""
    with click_errors():
        images = _cache(store_dir, capacity, high_watermark).images()
    if as_json:
        click.echo(json.dumps([i.to_json() for i in images]))
        return
    for i in images:
        refs = ",".join(i.references) or "-"
        click.echo(
            f"{i.digest[7:19]}  {i.name}:{i.tag or '-'}  {i.platform or '-'}  "
            f"{i.layers} layers  {format_size(i.size)}  refs={refs}"
        )


@image.command()
@click.argument("image_key", metavar="IMAGE")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print the removed image as JSON.")
def rm(
    image_key: str, store_dir: Path, capacity: str | None, high_watermark: float, as_json: bool
) -> None:
    """Remove IMAGE (digest, unique digest prefix, or NAME:TAG); refused while an
    endpoint references it."""
    with click_errors():
        img = _cache(store_dir, capacity, high_watermark).rm(image_key)
    click.echo(json.dumps(img.to_json()) if as_json else f"removed {img.name}@{img.digest}")


@image.command(name="ref")
@click.argument("image_key", metavar="IMAGE")
@click.argument("endpoint")
@store_option
def ref_(
    image_key: str, endpoint: str, store_dir: Path, capacity: str | None, high_watermark: float
) -> None:
    """Record that ENDPOINT uses IMAGE (never evicted or removed while referenced)."""
    with click_errors():
        img = _cache(store_dir, capacity, high_watermark).ref(image_key, endpoint)
    click.echo(f"{img.digest} referenced by {', '.join(img.references)}")


@image.command()
@click.argument("image_key", metavar="IMAGE")
@click.argument("endpoint")
@store_option
def unref(
    image_key: str, endpoint: str, store_dir: Path, capacity: str | None, high_watermark: float
) -> None:
    """Drop ENDPOINT's reference; the last reference going removes the image."""
    with click_errors():
        gone = _cache(store_dir, capacity, high_watermark).unref(image_key, endpoint)
    click.echo("removed (last reference)" if gone else "still referenced")


@image.command()
@store_option
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (keep it node-local)."
)
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="Port of the mirror.")
@click.option(
    "--upstream",
    default=None,
    metavar="URL",
    help="Registry to forward misses to, e.g. http://127.0.0.1:5000 (default: a miss is 404).",
)
@click.option(
    "--tag-ttl",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="With --upstream: re-resolve a cached tag there when its resolution is older than "
    "this (a moved tag is fetched through); 0 serves tags as pulled. Digests never refresh.",
)
def serve(
    store_dir: Path,
    capacity: str | None,
    high_watermark: float,
    host: str,
    port: int,
    upstream: str | None,
    tag_ttl: float,
) -> None:
    """Serve the cached images read-only over the registry API (a node-local mirror).

    \b
    GET/HEAD /v2/, /v2/NAME/manifests/REF, /v2/NAME/blobs/DIGEST (Range) come from the
    store; anything it lacks is forwarded to --upstream. Point containerd at it with a
    hosts.toml (docs/images.md), or try it with skopeo:
      preheat image serve --store /srv/preheat --port 5001 --upstream http://127.0.0.1:5000
      skopeo copy --src-tls-verify=false docker://127.0.0.1:5001/team/app:v1 oci:/tmp/app
    """
    import asyncio

    from preheat.images.mirror import serve as run

    with click_errors():
        cache = _cache(store_dir, capacity, high_watermark)
    ttl = f", tags re-resolved after {tag_ttl:g} s" if upstream and tag_ttl > 0 else ""
    click.echo(f"mirror on http://{host}:{port} (upstream {upstream or 'none'}{ttl})", err=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(cache, host, port, upstream, tag_ttl=tag_ttl))


image.add_command(revoke_command("image"))
image.add_command(unrevoke_command("image"))
