"""Endpoint spec and cluster files: read YAML from disk, resolve paths, then validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from preheat.control.spec_schema import parse_cluster, parse_endpoint
from preheat.control.spec_types import ClusterSpec, EndpointSpec, NodeSpec
from preheat.errors import ConfigError

__all__ = ["default_cluster", "load_cluster", "load_endpoint"]


def _read_yaml(path: Path, what: str) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {exc}") from None


def load_endpoint(path: str | Path) -> EndpointSpec:
    """Read and validate an endpoint spec file."""
    p = Path(path)
    return parse_endpoint(_read_yaml(p, "endpoint spec"), origin=f"endpoint spec {str(p)!r}")


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster file; store paths are relative to the file."""
    p = Path(path)
    return parse_cluster(
        _read_yaml(p, "cluster file"),
        base_dir=p.resolve().parent,
        origin=f"cluster file {str(p)!r}",
    )


def default_cluster(state_dir: Path, *, capacity: int, nodes: int = 1) -> ClusterSpec:
    """The cluster ``preheat up`` uses without ``--cluster``: local nodes under the state dir."""
    return ClusterSpec(
        nodes=tuple(
            NodeSpec(name=f"local-{i}", store=state_dir / "nodes" / f"local-{i}", capacity=capacity)
            for i in range(nodes)
        )
    )
