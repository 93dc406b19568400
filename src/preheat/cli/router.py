"""``preheat router``: run the prefix-aware OpenAI-compatible proxy."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from preheat.errors import ConfigError
from preheat.router.policies import POLICIES
from preheat.router.policies.base import PLACEMENTS, PolicyParams

#: Option defaults come from the policy's own parameters (one source of truth).
_P = PolicyParams()

if TYPE_CHECKING:
    from preheat.runtime.kubernetes.discovery import Discovery


@click.group()
def router() -> None:
    """The router: sends requests that share a prompt prefix to the instance that holds it."""


@router.command()
@click.option("--port", type=int, required=True, help="Port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--backend",
    "backends",
    multiple=True,
    metavar="URL",
    help="An instance URL (http://host:port); repeat for each. Not with --config.",
)
@click.option(
    "--strategy",
    type=click.Choice(sorted(POLICIES)),
    default="random",
    show_default=True,
    help="Routing strategy of the single variant built from --backend.",
)
@click.option(
    "--prefix-length",
    type=int,
    default=_P.prefix_length,
    show_default=True,
    help="prefix_aware: characters of canonical prompt in the key (1024-65536).",
)
@click.option(
    "--concurrency-threshold",
    type=int,
    default=_P.concurrency_threshold,
    show_default=True,
    help="prefix_aware: in-flight requests at which an instance takes no more (1-1024).",
)
@click.option(
    "--balance-epsilon",
    type=float,
    default=_P.balance_epsilon,
    show_default=True,
    help="prefix_aware: skip an instance above (1+eps) x mean in-flight.",
)
@click.option(
    "--load-weight",
    type=float,
    default=_P.load_weight,
    show_default=True,
    help="prefix_aware: how strongly excess load offsets a cached prefix (0 = hits only).",
)
@click.option(
    "--placement",
    type=click.Choice(list(PLACEMENTS)),
    default=_P.placement,
    show_default=True,
    help="prefix_aware: stable-move (the default: stable, plus a heavy cold prefix on an "
    "instance 10% above the mean load moved once to a less loaded one), stable (hot "
    "prefixes own a replica set sized by "
    "their traffic share, cold prefixes are partitioned over the fleet's KV memory by "
    "capacity- and balance-weighted rendezvous hashing and then stay, chat turns "
    "follow their conversation, spill only at --concurrency-threshold; replicas agree "
    "on document and template traffic), stable-split (a heavy cold prefix copied to a "
    "second instance instead), learned (least predicted time to first token: "
    "the prompt's uncached part on each instance, from a KV-capacity-aware index, plus "
    "its queued prefill, within load and share bounds), hash "
    "(stateless rendezvous; replicas agree whatever order they see requests in) or "
    "hybrid (stable home keys, hot prefixes spread over several instances; replicas "
    "agree whatever their in-flight counts unless they see requests in a different "
    "order; near learned's hit rate and balance).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A YAML/JSON router config (variants, instances, timeouts); see docs/routing.md.",
)
@click.option(
    "--admin-token",
    envvar="PREHEAT_ADMIN_TOKEN",
    help="Bearer token of the /admin API. Prefer env PREHEAT_ADMIN_TOKEN or "
    "--admin-token-file: a token on the command line is visible to every local user. "
    "Without a token the admin API answers 403.",
)
@click.option(
    "--admin-token-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="File holding the admin token (mode 0600: refused if group or others can read it).",
)
@click.option(
    "--salt-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="File with the secret routing salt (or env PREHEAT_ROUTER_SALT). Replicas must "
    "share it to agree; without one a random salt is used.",
)
@click.option(
    "--decision-log",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append sampled routing decisions to this JSONL file (never prompt text).",
)
@click.option(
    "--decision-sample",
    type=float,
    default=1.0,
    show_default=True,
    help="Share of requests written to --decision-log (0-1).",
)
@click.option(
    "--upstream-timeout",
    type=float,
    default=None,
    help="Seconds without a byte from an instance before 504 (default 300).",
)
@click.option(
    "--health-interval", type=float, default=None, help="Seconds between health checks (2)."
)
@click.option(
    "--kubernetes",
    is_flag=True,
    help="Kubernetes mode: instances from the --endpoint's EndpointSlices, strategy and "
    "thresholds from its InferenceEndpoint spec, both followed live (docs/kubernetes.md).",
)
@click.option("--endpoint", metavar="NAME", help="--kubernetes: the InferenceEndpoint to serve.")
@click.option(
    "--namespace",
    metavar="N",
    help="--kubernetes: its namespace (default: the kubeconfig context's, the pod's, or "
    "'default').",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False, path_type=Path),
    help="--kubernetes: kubeconfig file (default: KUBECONFIG, ~/.kube/config, else the "
    "in-cluster ServiceAccount).",
)
@click.option(
    "--kv-events",
    "kv_events",
    multiple=True,
    metavar="URL=tcp://HOST:PORT",
    help="An instance's KV-event publisher (vLLM --kv-events-config, preheat engine serve "
    "--kv-events): the router subscribes and routes prefix_aware on the blocks the engine "
    "announces, falling back to its learned index on a gap or silence. Repeat per "
    "instance; also `kv_events:` per instance in --config.",
)
@click.option(
    "--kv-events-options",
    "kv_events_options",
    metavar="KEY=VALUE&...",
    help="How every instance's engine hashes prompts, for the --kv-events instances and "
    "(with --kubernetes) the discovered ones: tokenizer (a model snapshot dir or its "
    "tokenizer.json; default 'engine', the simulated engine's), hash (builtin, sha256, "
    "sha256_cbor: vLLM's --prefix-caching-hash-algo), hash_seed (the engine's "
    "PYTHONHASHSEED, required by sha256*), block_size (vLLM's --block-size, 16). "
    "An instance's own setting wins. E.g. "
    "'tokenizer=/models/llama&hash=sha256_cbor&hash_seed=0'. Also `kv_events_options:` "
    "in --config.",
)
@click.option(
    "--kv-events-silence",
    type=float,
    default=None,
    metavar="S",
    help="Seconds an instance may owe KV events before the router stops trusting them "
    "and uses its learned index for it (default 5; kv_events_silence_s in --config).",
)
@click.option(
    "--front",
    type=click.Choice(["raw", "aiohttp"]),
    default="raw",
    show_default=True,
    help="The server on --port: raw (an HTTP/1.1 protocol with httptools serves the two "
    "proxy routes, everything else is relayed to the aiohttp application on a private "
    "unix socket; least added latency) or aiohttp (aiohttp serves every route); with "
    "--kubernetes too.",
)
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level.")
def serve(
    port: int,
    host: str,
    backends: tuple[str, ...],
    strategy: str,
    prefix_length: int,
    concurrency_threshold: int,
    balance_epsilon: float,
    load_weight: float,
    placement: str,
    config_file: Path | None,
    admin_token: str | None,
    admin_token_file: Path | None,
    salt_file: Path | None,
    decision_log: Path | None,
    decision_sample: float,
    upstream_timeout: float | None,
    health_interval: float | None,
    kubernetes: bool,
    endpoint: str | None,
    namespace: str | None,
    kubeconfig: Path | None,
    kv_events: tuple[str, ...],
    kv_events_options: str | None,
    kv_events_silence: float | None,
    front: str,
    log_level: str,
) -> None:
    """Run the router on --port in front of --backend URLs (or a --config file).

    \b
    Example:
      preheat router serve --port 8080 --strategy prefix_aware \\
          --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 \\
          --admin-token-file ~/.preheat/admin-token
    A variant may start with no instance (requests get 503 + Retry-After until
    POST /admin/instances/add gives it one).

    \b
    In a cluster (the rendered router Deployment runs this):
      preheat router serve --kubernetes --endpoint chat --port 8080
    """
    from preheat.router.config import (
        check_kv_events_options,
        load_config,
        parse_config,
        with_kv_events,
    )
    from preheat.router.server import Router, run
    from preheat.telemetry.routing import DecisionLog

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    discovery = None
    try:
        kv_options = (
            check_kv_events_options(kv_events_options, where="--kv-events-options")
            if kv_events_options is not None
            else {}
        )
        if kubernetes:
            discovery = _discovery(
                endpoint, namespace, kubeconfig, config_file, backends, kv_options
            )
            cfg = parse_config({"variants": [{"name": "default", "instances": []}]})
        elif endpoint or namespace or kubeconfig:
            raise ConfigError("--endpoint, --namespace and --kubeconfig need --kubernetes")
        elif config_file is not None:
            if backends:
                raise ConfigError("give either --config or --backend, not both")
            cfg = load_config(config_file)
        else:
            cfg = parse_config(
                {
                    "variants": [
                        {
                            "name": "default",
                            "strategy": strategy,
                            "prefix_length": prefix_length,
                            "concurrency_threshold": concurrency_threshold,
                            "balance_epsilon": balance_epsilon,
                            "load_weight": load_weight,
                            "placement": placement,
                            "instances": list(backends),
                        }
                    ]
                }
            )
        raw = cfg.to_dict()
        if upstream_timeout is not None:
            raw["upstream_timeout_s"] = upstream_timeout
        if health_interval is not None:
            raw["health"]["interval_s"] = health_interval
        if kv_events_silence is not None:
            raw["kv_events_silence_s"] = kv_events_silence
        if kv_options:
            if raw["kv_events_options"]:
                raise ConfigError(
                    "give kv_events_options either in --config or as --kv-events-options, not both"
                )
            raw["kv_events_options"] = kv_options
        cfg = with_kv_events(parse_config(raw), _kv_events(kv_events))
        if discovery is not None:
            cfg = discovery.initial_config(cfg)
        admin_token = _admin_token(admin_token, admin_token_file)
        salt = _salt(salt_file)
        rng = random.Random(secrets.randbits(64))
        dlog = (
            DecisionLog(decision_log, decision_sample, rng=random.Random(secrets.randbits(64)))
            if decision_log is not None
            else None
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    live = Router(cfg, salt=salt, admin_token=admin_token, decision_log=dlog, rng=rng)
    if discovery is None:
        run(live, host=host, port=port, front=front)
        return
    found = discovery

    async def ready() -> None:  # the watches feed the router's loop once it listens
        found.start(live, asyncio.get_running_loop())

    try:
        run(live, host=host, port=port, front=front, ready=ready)
    finally:
        found.stop()


def _discovery(
    endpoint: str | None,
    namespace: str | None,
    kubeconfig: Path | None,
    config_file: Path | None,
    backends: tuple[str, ...],
    kv_options: dict[str, str],
) -> Discovery:
    """Kubernetes mode's discovery, connected; the options it conflicts with refused."""
    from urllib.parse import urlencode

    from preheat.runtime.kubernetes.api_client import connect
    from preheat.runtime.kubernetes.discovery import Discovery

    if not endpoint:
        raise ConfigError("--kubernetes needs --endpoint NAME (the InferenceEndpoint to serve)")
    if config_file is not None or backends:
        raise ConfigError(
            "--kubernetes takes its instances and routing from the cluster; "
            "leave out --config and --backend"
        )
    api, context_namespace = connect(kubeconfig)
    return Discovery(
        api,
        namespace or context_namespace or "default",
        endpoint,
        kv_events_options=urlencode(kv_options, safe=":/"),
    )


def _kv_events(given: tuple[str, ...]) -> dict[str, str]:
    """``--kv-events URL=tcp://...`` options as {instance URL: setting}; the URLs checked
    here, the settings by ``with_kv_events`` (with ``kv_events_options`` applied)."""
    from preheat.router.config import check_url

    out: dict[str, str] = {}
    for item in given:
        url, sep, endpoint = item.partition("=")
        if not sep:
            raise ConfigError(
                f"--kv-events {item!r} needs INSTANCE_URL=tcp://HOST:PORT, e.g. "
                "http://127.0.0.1:8001=tcp://127.0.0.1:5557"
            )
        url = check_url(url, where="--kv-events")
        out[url] = endpoint
    return out


def _admin_token(given: str | None, path: Path | None) -> str | None:
    """The admin token from --admin-token-file, PREHEAT_ADMIN_TOKEN or --admin-token (the
    last with a warning: argv is world-readable in /proc/PID/cmdline)."""
    source = click.get_current_context().get_parameter_source("admin_token")
    on_argv = source is click.core.ParameterSource.COMMANDLINE
    if path is not None:
        if on_argv:
            raise ConfigError("give either --admin-token or --admin-token-file, not both")
        return _read_secret_file(path, "--admin-token-file")
    if on_argv:
        click.echo(
            "preheat router: warning: --admin-token on the command line is visible to every "
            "local user (ps, /proc/PID/cmdline); pass it in PREHEAT_ADMIN_TOKEN or "
            "--admin-token-file (mode 0600) instead",
            err=True,
        )
    return given or None


def _read_secret_file(path: Path, option: str) -> str:
    """A secret from a file only its owner can read; the error says how to fix the mode."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(
            f"{option} {path} has mode {mode:04o}: group or others can read the secret; "
            f"run `chmod 600 {path}`"
        )
    text = path.read_text().strip()
    if not text:
        raise ConfigError(f"{option} {path} is empty; write the token into it")
    return text


def _salt(path: Path | None) -> bytes:
    if path is not None:
        data = path.read_bytes().strip()
    elif os.environ.get("PREHEAT_ROUTER_SALT"):
        data = os.environ["PREHEAT_ROUTER_SALT"].encode()
    else:
        click.echo(
            "preheat router: no --salt-file or PREHEAT_ROUTER_SALT; using a random salt "
            "(router replicas will not agree on placement)",
            err=True,
        )
        return secrets.token_bytes(32)
    if len(data) < 16:
        raise ConfigError(f"the routing salt is {len(data)} bytes; give at least 16")
    # Any length of user material becomes a fixed-size key.
    return hashlib.sha256(data).digest()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(router())
