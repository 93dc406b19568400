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
    "--peer-port", type=click.IntRange(0, 65535), default=None,
    help="Serve this node's blobs to the other agents on PORT and fill from them "
    "(needs --peer-token-file; 0: any free port). Without it: origin only, within the "
    "cluster's origin budget (--namespace).",
)  # fmt: skip
@click.option(
    "--peer-token-file", type=click.Path(dir_okay=False, path_type=Path),
    help="File holding the cluster's peer token (the preheat-peer-token Secret, mounted).",
)  # fmt: skip
@click.option("--peer-host", default=None, help="Address the peer server binds (default: --host).")
@click.option(
    "--peer-url", default=None,
    help="URL other agents reach this one at, e.g. http://$(POD_IP):9102 (default: host:port).",
)  # fmt: skip
@click.option(
    "--namespace", "peer_namespace", default="preheat-system", show_default=True,
    help="Namespace of the origin slot Leases and the preheat-settings ConfigMap (read "
    "with or without peers: origin.budget.concurrentFills holds for every agent).",
)  # fmt: skip
@click.option(
    "--lease-seconds", type=click.FloatRange(1), default=15.0, show_default=True,
    help="An origin slot not renewed for this long is taken over by another agent.",
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
@click.option(
    "--containerd-hosts-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="containerd's config_path (the host's /etc/containerd/certs.d, mounted): write a "
    "hosts.toml per registry of the images cached here, pointing at the mirror (needs "
    "--mirror-port); the agent removes the ones it wrote when no image cache needs them.",
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
    peer_port: int | None,
    peer_token_file: Path | None,
    peer_host: str | None,
    peer_url: str | None,
    peer_namespace: str,
    lease_seconds: float,
    mirror_port: int | None,
    mirror_upstream: str | None,
    containerd_hosts_dir: Path | None,
) -> None:
    """Own this node's store: warm the ModelDataCaches that target the node, pre-pull the
    images its ModelImageCaches name (referenced per endpoint), write its NodeCache status
    and revision labels, lease snapshots for its pods, serve /metrics and /inventory, and
    with --mirror-port the node image mirror."""
    from preheat.runtime.kubernetes.agent import AgentConfig, run_agent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        from preheat.runtime.kubernetes.agent_peers import OriginOnly
        from preheat.runtime.kubernetes.agent_peers_config import PeerConfig

        if (peer_port is None) != (peer_token_file is None):
            raise ConfigError("--peer-port and --peer-token-file go together; pass both or neither")
        # without peer flags: no peers, but the cluster's origin budget (agent_peers)
        peers: PeerConfig = OriginOnly(namespace=peer_namespace, lease_seconds=lease_seconds)
        if peer_port is not None and peer_token_file is not None:
            peers = PeerConfig(
                token_file=peer_token_file, port=peer_port, host=peer_host or host,
                url=peer_url, namespace=peer_namespace, lease_seconds=lease_seconds,
            )  # fmt: skip
        cfg = AgentConfig(
            node=node,
            store=store,
            capacity=None if capacity is None else parse_size(capacity, what="--capacity"),
            port=port,
            host=host,
            max_warmups=max_warmups,
            resync_s=resync,
            backoff_s=min(backoff, 30.0),
            peers=peers,
            mirror_port=mirror_port,
            mirror_upstream=mirror_upstream,
            containerd_hosts_dir=containerd_hosts_dir,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    run_agent(cfg, kubeconfig)
