"""``preheat metrics-adapter``: the External metrics API the rendered HPAs read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from pathlib import Path

import click

from preheat.errors import ConfigError


@click.command("metrics-adapter")
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, else in-cluster).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=6443, show_default=True,
    help="HTTPS port (0: any free port, printed on start).",
)  # fmt: skip
@click.option(
    "--tls-cert-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Serving certificate (PEM). Without it one is generated for the --tls-san names.",
)  # fmt: skip
@click.option(
    "--tls-private-key-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Key of --tls-cert-file (PEM).",
)  # fmt: skip
@click.option(
    "--cert-dir", type=click.Path(file_okay=False, path_type=Path),
    help="Where a generated certificate is written (tls.crt, tls.key); default: a "
    "temporary directory. Read tls.crt from here for the APIService's caBundle.",
)  # fmt: skip
@click.option(
    "--tls-san", "sans", multiple=True,
    help="A DNS name or IP of the generated certificate (repeatable); the aggregator "
    "verifies SERVICE.NAMESPACE.svc. Default: the --host address.",
)  # fmt: skip
@click.option(
    "--scrape-timeout", type=click.FloatRange(0.1), default=2.0, show_default=True,
    help="Seconds one router's /metrics may take before the request fails (503).",
)  # fmt: skip
@click.option(
    "--authz-cache", type=click.FloatRange(0), default=10.0, show_default=True,
    help="Seconds a SubjectAccessReview answer is reused for the same caller and request.",
)  # fmt: skip
def metrics_adapter(
    kubeconfig: Path | None,
    host: str,
    port: int,
    tls_cert_file: Path | None,
    tls_private_key_file: Path | None,
    cert_dir: Path | None,
    sans: tuple[str, ...],
    scrape_timeout: float,
    authz_cache: float,
) -> None:
    """Serve external.metrics.k8s.io/v1beta1 (preheat_router_in_flight per endpoint
    variant, summed from the endpoint's routers' /metrics) to the HPA controller through
    the API server's aggregator (the APIService from `preheat k8s render`). Requests are
    accepted only from the aggregator's front-proxy certificate and authorized with
    SubjectAccessReviews. Runs until SIGINT/SIGTERM."""
    from preheat.runtime.kubernetes.api_client import connect
    from preheat.runtime.kubernetes.metrics_adapter import AdapterConfig, MetricsAdapter, serve
    from preheat.runtime.kubernetes.metrics_adapter_tls import ServingCert, generate_self_signed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if (tls_cert_file is None) != (tls_private_key_file is None):
        raise click.UsageError("give both --tls-cert-file and --tls-private-key-file, or neither")
    with tempfile.TemporaryDirectory(prefix="preheat-adapter-") as tmp:
        try:
            if tls_cert_file is not None and tls_private_key_file is not None:
                serving = ServingCert(tls_cert_file, tls_private_key_file)
            else:
                serving = generate_self_signed(cert_dir or Path(tmp), list(sans) or [host])
            api, _ = connect(kubeconfig)
            config = AdapterConfig(host, port, serving, scrape_timeout, authz_cache)
            adapter = MetricsAdapter.connect(api, config)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None

        def ready(bound: int) -> None:
            click.echo(f"preheat metrics-adapter: listening on https://{host}:{bound}", err=True)

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(adapter, ready=ready))
