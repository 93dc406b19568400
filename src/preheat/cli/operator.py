"""``preheat operator`` (the Kubernetes operator) and ``preheat snapshot-init`` (the engine
pod's init container the operator's Deployments run)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click

from preheat.errors import ConfigError, PreheatError


@click.command()
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, exists=True),
    help="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, else in-cluster).",
)
@click.option(
    "--namespace", "-n", help="Reconcile InferenceEndpoints in this namespace only (default: all)."
)
@click.option(
    "--metrics-port", type=click.IntRange(0, 65535), default=9100, show_default=True,
    help="Port of /metrics (0: any free port, printed on start).",
)  # fmt: skip
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address of /metrics.")
@click.option(
    "--rollout-deadline", type=click.IntRange(5), default=600, show_default=True,
    help="Seconds a new version's pods may take to become ready before it is rolled back "
    "(also the Deployments' progressDeadlineSeconds).",
)  # fmt: skip
@click.option(
    "--tick", type=click.FloatRange(0.1), default=2.0, show_default=True,
    help="Seconds between reconcile passes when no watched object changes.",
)  # fmt: skip
def operator(
    kubeconfig: str | None,
    namespace: str | None,
    metrics_port: int,
    metrics_host: str,
    rollout_deadline: int,
    tick: float,
) -> None:
    """Reconcile InferenceEndpoints: a ModelDataCache per model revision, the Deployment held
    until minReady target nodes hold it (then preferred affinity for warm nodes), a Service
    per variant for the router, surge rollouts with rollback, status conditions and Events.
    Runs until SIGINT/SIGTERM (kopf, standalone)."""
    from preheat.runtime.kubernetes.api_client import connect
    from preheat.runtime.kubernetes.k8s_executor import OperatorConfig
    from preheat.runtime.kubernetes.operator import OperatorContext, run_operator

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        api, _ = connect(Path(kubeconfig) if kubeconfig else None)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    ctx = OperatorContext(api, OperatorConfig(rollout_deadline_s=rollout_deadline, tick_s=tick))
    asyncio.run(
        run_operator(
            ctx,
            namespace=namespace,
            kubeconfig=kubeconfig,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
        )
    )


@click.command("snapshot-init")
@click.option(
    "--store", required=True, type=click.Path(file_okay=False, path_type=Path),
    help="The node store (read-only hostPath).",
)  # fmt: skip
@click.option("--source", required=True, help="Artifact ref to pull from on a cold node.")
@click.option("--revision", required=True, help="The revision the source must resolve to.")
@click.option("--digest", help="Manifest digest of the snapshot (looked up in the node store).")
@click.option(
    "--out", required=True, type=click.Path(path_type=Path),
    help="Path that becomes the snapshot (a link into the node store or a pod-local pull).",
)  # fmt: skip
@click.option(
    "--peer-token-file", type=click.Path(dir_okay=False, path_type=Path),
    help="The cluster's peer token (the preheat-peer-token Secret, mounted): a cold pull "
    "takes pieces from the node agents' peer servers first.",
)  # fmt: skip
@click.option(
    "--peer", "peer_urls", multiple=True, metavar="URL",
    help="A node agent's peer server (repeat it); see also --peers-from-nodecaches.",
)  # fmt: skip
@click.option(
    "--peers-from-nodecaches", is_flag=True,
    help="Take the peer URLs from the NodeCache objects (in-cluster credentials).",
)  # fmt: skip
def snapshot_init(
    store: Path,
    source: str,
    revision: str,
    digest: str | None,
    out: Path,
    peer_token_file: Path | None,
    peer_urls: tuple[str, ...],
    peers_from_nodecaches: bool,
) -> None:
    """Make --out the model snapshot: the node's copy when it holds one, else a pull (from
    peers first when given, then the origin) into the pod's own directory. Prints one JSON
    line (warm, bytes_fetched, bytes_from)."""
    from preheat.runtime.kubernetes.snapshot_init import dumps, peers_for, prepare_snapshot

    try:
        token, peers = peers_for(peer_token_file, peer_urls, peers_from_nodecaches)
        result = prepare_snapshot(
            store=store, source=source, revision=revision, digest=digest, out=out,
            peers=peers, token=token,
        )  # fmt: skip
    except PreheatError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(dumps(result))
