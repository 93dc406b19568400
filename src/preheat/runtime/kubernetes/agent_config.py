"""The node agent's configuration and its Kubernetes API helpers: the ``AgentConfig`` that
``preheat agent`` builds, the ``ApiClient`` it connects with, and the one redacted line an
API failure is logged as."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from preheat.artifacts.refs import redact_url
from preheat.errors import ConfigError

if TYPE_CHECKING:
    from preheat.runtime.kubernetes.agent_peers_config import PeerConfig

__all__ = ["AgentConfig", "api_client_from", "describe_error"]


@dataclass(frozen=True)
class AgentConfig:
    """What ``preheat agent`` was asked to do."""

    node: str
    store: Path
    capacity: int | None = None
    port: int = 9101
    host: str = "127.0.0.1"
    max_warmups: int = 2
    resync_s: float = 10.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    #: Serve and use peers (``--peer-port``/``--peer-token-file``); None: origin only.
    peers: PeerConfig | None = None

    # image cache (issue 11): the node mirror on 127.0.0.1 (None: not served)
    mirror_port: int | None = None
    mirror_upstream: str | None = None
    #: containerd's ``config_path`` (``/etc/containerd/certs.d``): the agent writes a
    #: ``hosts.toml`` per registry it caches images of (``agent_containerd.py``).
    containerd_hosts_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.containerd_hosts_dir is not None and self.mirror_port is None:
            raise ConfigError(
                "--containerd-hosts-dir needs --mirror-port: the hosts.toml files point "
                "containerd at the node mirror"
            )
        if not self.node:
            raise ConfigError("--node is empty; pass the Node's name (the DaemonSet sets it)")
        if self.max_warmups < 1:
            raise ConfigError(f"max_warmups {self.max_warmups} must be >= 1")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ConfigError(
                f"back-off {self.backoff_s}..{self.backoff_max_s} s must satisfy 0 < min <= max"
            )


def api_client_from(kubeconfig: str | None) -> Any:
    """A ``kubernetes`` ApiClient: ``kubeconfig``, else ``$KUBECONFIG`` or ``~/.kube/config``,
    else the in-cluster ServiceAccount."""
    from kubernetes import client, config

    path = kubeconfig or os.environ.get("KUBECONFIG")
    default = Path.home() / ".kube" / "config"
    if path or default.is_file():
        return config.new_client_from_config(config_file=path or str(default))
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException as exc:
        raise ConfigError(
            f"no Kubernetes credentials: {exc}; pass --kubeconfig FILE or set KUBECONFIG"
        ) from exc
    return client.ApiClient(cfg)


def describe_error(exc: BaseException) -> str:
    """One redacted line for a failure (an ApiException's status and message, not its headers)."""
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    if status is not None and body:
        try:
            msg = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            msg = body
        return redact_url(f"API answered {status}: {msg}")
    return redact_url(f"{type(exc).__name__}: {exc}")
