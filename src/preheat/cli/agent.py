"""``preheat agent``: the Kubernetes node agent (one per node, run by the DaemonSet)."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from preheat.config import parse_size
from preheat.errors import ConfigError


@click.command()
@click.option(
    "--node", required=True, help="This Node's name (the DaemonSet passes spec.nodeName)."
)
@click.option(
    "--store",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The node store directory (a hostPath in a cluster).",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, exists=True),
    help="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, else in-cluster).",
)
@click.option("--capacity", help="Bytes the store may hold, e.g. 200GiB (default: the disk).")
@click.option(
    "--metrics-port",
    "--port",
    "port",
    type=click.IntRange(0, 65535),
    default=9101,
    show_default=True,
    help="Port of /metrics and /inventory (0: any free port, printed on start).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve on.")
@click.option(
    "--max-warmups", type=click.IntRange(1), default=2, show_default=True,
    help="Revisions warmed at once.",
)  # fmt: skip
@click.option(
    "--resync", type=click.FloatRange(0.1), default=10.0, show_default=True,
    help="Seconds between full reconciles when no event arrives.",
)  # fmt: skip
@click.option(
    "--backoff", type=click.FloatRange(0.01), default=1.0, show_default=True,
    help="First retry delay of a failed warm-up in seconds (doubles up to 30 s).",
)  # fmt: skip
@click.option(
    "--mirror-port", type=click.IntRange(0, 65535), default=None,
    help="Also serve the node image mirror (read-only registry API over this store) on "
    "127.0.0.1:PORT, for containerd's hosts.toml (`preheat k8s render --containerd-mirror`).",
)  # fmt: skip
@click.option(
    "--mirror-upstream", metavar="URL",
    help="Where the mirror forwards what the store lacks (e.g. https://registry.example); "
    "default: a registry-style 404, so containerd falls back to the registry itself.",
)  # fmt: skip
def agent(
    node: str,
    store: Path,
    kubeconfig: str | None,
    capacity: str | None,
    port: int,
    host: str,
    max_warmups: int,
    resync: float,
    backoff: float,
    mirror_port: int | None,
    mirror_upstream: str | None,
) -> None:
    """Own this node's store: warm the ModelDataCaches that target the node, pre-pull the
    images its ModelImageCaches name (referenced per endpoint), write its NodeCache status
    and revision labels, lease snapshots for its pods, serve /metrics and /inventory, and
    with --mirror-port the node image mirror."""
    from preheat.runtime.kubernetes.agent import AgentConfig, run_agent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = AgentConfig(
            node=node,
            store=store,
            capacity=None if capacity is None else parse_size(capacity, what="--capacity"),
            port=port,
            host=host,
            max_warmups=max_warmups,
            resync_s=resync,
            backoff_s=min(backoff, 30.0),
            mirror_port=mirror_port,
            mirror_upstream=mirror_upstream,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    run_agent(cfg, kubeconfig)
