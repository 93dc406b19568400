"""What a node agent needs to serve and use peers (``preheat agent --peer-port``), and the
cluster's peer settings it reads from the ``preheat-settings`` ConfigMap: the same
``origin.budget`` / ``peers`` keys as the local cluster file (docs/peers.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from preheat.control.fanout import Budget
from preheat.errors import ConfigError

__all__ = [
    "SETTINGS_CONFIGMAP",
    "SETTINGS_KEY",
    "PeerConfig",
    "PeerSettings",
    "parse_settings",
    "read_token",
]

#: The ConfigMap (in the agents' namespace) and its key holding the cluster's peer settings.
SETTINGS_CONFIGMAP = "preheat-settings"
SETTINGS_KEY = "settings.yaml"


@dataclass(frozen=True)
class PeerConfig:
    """``--peer-*`` options of ``preheat agent``."""

    token_file: Path
    port: int = 9102
    host: str = "127.0.0.1"
    #: The URL other agents reach this one at (in a pod: ``http://$(POD_IP):PORT``);
    #: default ``http://HOST:PORT``.
    url: str | None = None
    namespace: str = "preheat-system"
    settings: str = SETTINGS_CONFIGMAP
    #: Seconds an origin slot's Lease lasts without a renewal before others take it over.
    lease_seconds: float = 15.0
    #: Seconds between looks while a warm-up waits for a peer or an origin slot, and
    #: between reads of the others' NodeCaches while it fills from peers.
    poll_s: float = 1.0
    #: Seconds between NodeCache status writes while a fill runs (``status.peer.filling``,
    #: the pieces landed; written only when it changed): at most one write per period.
    progress_s: float = 1.0
    #: Seconds a fill from peers waits for a seed that lands no piece (then: the origin
    #: for that piece), as in local mode (``runtime.peering.FleetPeers.seed_stall``).
    seed_stall: float = 20.0

    def __post_init__(self) -> None:
        if self.lease_seconds < 1:
            raise ConfigError(f"--lease-seconds {self.lease_seconds} must be >= 1")
        if self.progress_s <= 0 or self.poll_s <= 0 or self.seed_stall <= 0:
            raise ConfigError(
                f"peer timings must be > 0 seconds (poll {self.poll_s}, progress "
                f"{self.progress_s}, seed stall {self.seed_stall})"
            )


@dataclass(frozen=True)
class PeerSettings:
    """The cluster's peer settings (``PeerSettings()``: no ConfigMap, the defaults)."""

    budget: Budget = field(default_factory=Budget)
    enabled: bool = True
    #: ``origin.bandwidth``: each node's download link in bytes/s (from the origin and
    #: from peers); None: unlimited.
    node_bandwidth: int | None = None


def read_token(path: Path) -> str:
    """The cluster token from its file (a mounted Secret); never echoed in an error."""
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the peer token file {path}: {exc.strerror}; mount the "
            "preheat-peer-token Secret there (docs/kubernetes.md, 'Peers')"
        ) from None
    if len(token) < 16:
        raise ConfigError(
            f"the peer token in {path} is shorter than 16 characters; generate one with "
            "`openssl rand -base64 32` and store it in the preheat-peer-token Secret"
        )
    return token


def parse_settings(text: str | None, where: str = "ConfigMap preheat-settings") -> PeerSettings:
    """``origin.budget`` and ``peers`` from the ConfigMap's ``settings.yaml``, validated as
    the cluster file's (``control.spec_schema``); None or empty: the defaults."""
    from preheat.control.spec_schema import parse_cluster

    if not text or not text.strip():
        return PeerSettings()
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {SETTINGS_KEY} is not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {SETTINGS_KEY} must be a mapping with origin / peers")
    unknown = sorted(set(data) - {"origin", "peers"})
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} in {SETTINGS_KEY}; "
            "only origin (bandwidth, budget) and peers (enabled) are read"
        )
    # the cluster file's validation (it wants a node list: one placeholder)
    cluster = parse_cluster(
        {**data, "nodes": [{"name": "settings"}]}, base_dir=Path(os.sep), origin=where
    )
    return PeerSettings(cluster.origin.budget, cluster.peers.enabled, cluster.origin.bandwidth)
