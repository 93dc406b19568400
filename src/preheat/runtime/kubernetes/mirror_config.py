"""containerd registry mirror configuration for the node image cache (pure: no I/O).

containerd (1.5+, CRI ``config_path = "/etc/containerd/certs.d"``) reads one
``hosts.toml`` per upstream registry, at ``<config_path>/<registry host>/hosts.toml``.
Each ``[host."URL"]`` table is tried in order before ``server``; a host with
``capabilities = ["pull", "resolve"]`` may resolve tags and serve blobs. containerd adds
``?ns=<registry host>`` to mirror requests, which the preheat mirror uses to tell two
registries' repositories of the same name apart. A mirror that fails or answers 404
falls through to the next host and then to ``server``, so a cold node still pulls from
the upstream: the cache never blocks a pull.

::

    hosts_toml("registry.example:5000", "http://127.0.0.1:5001")
    # server = "https://registry.example:5000"
    #
    # [host."http://127.0.0.1:5001"]
    #   capabilities = ["pull", "resolve"]
"""

from __future__ import annotations

import re

from preheat.errors import ConfigError

DEFAULT_CONFIG_PATH = "/etc/containerd/certs.d"
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?$")
_LOOPBACK = re.compile(r"^(?:localhost|127(?:\.\d{1,3}){3}|\[::1\])(?::\d+)?$")


def _server(registry: str) -> str:
    if registry == "docker.io":
        return "https://registry-1.docker.io"
    scheme = "http" if _LOOPBACK.match(registry) else "https"
    return f"{scheme}://{registry}"


def hosts_toml(
    registry: str, mirror: str, *, capabilities: tuple[str, ...] = ("pull", "resolve")
) -> str:
    """The ``hosts.toml`` that sends pulls of ``registry`` (``host[:port]``, or
    ``docker.io``) to the node mirror at ``mirror`` (``http://127.0.0.1:PORT``) first."""
    if not _HOST.match(registry):
        raise ConfigError(
            f"registry {registry!r} is not host[:port]; write e.g. registry.example:5000"
        )
    if not re.match(r"^https?://[^/\s\"]+$", mirror):
        raise ConfigError(
            f"mirror {mirror!r} is not http(s)://host:port; write e.g. http://127.0.0.1:5001"
        )
    bad = [c for c in capabilities if c not in ("pull", "resolve", "push")]
    if bad or "push" in capabilities:
        raise ConfigError(
            f"mirror capabilities {list(capabilities)} must be a subset of ['pull', 'resolve'] "
            "(the mirror is read-only)"
        )
    caps = ", ".join(f'"{c}"' for c in capabilities)
    lines = [
        f'server = "{_server(registry)}"',
        "",
        f'[host."{mirror}"]',
        f"  capabilities = [{caps}]",
    ]
    return "\n".join(lines) + "\n"


def hosts_path(registry: str, config_path: str = DEFAULT_CONFIG_PATH) -> str:
    """Where containerd looks for ``registry``'s ``hosts.toml``."""
    if not _HOST.match(registry):
        raise ConfigError(f"registry {registry!r} is not host[:port]")
    return f"{config_path.rstrip('/')}/{registry}/hosts.toml"


def mirror_files(
    registries: list[str], mirror: str, config_path: str = DEFAULT_CONFIG_PATH
) -> dict[str, str]:
    """path -> contents of every ``hosts.toml`` for ``registries`` (what a node needs;
    ``preheat k8s render`` can put these in a ConfigMap the agent writes to the host)."""
    return {hosts_path(r, config_path): hosts_toml(r, mirror) for r in sorted(set(registries))}


def mirror_configmap(
    registries: list[str],
    mirror: str,
    *,
    namespace: str,
    name: str = "preheat-containerd-hosts",
    config_path: str = DEFAULT_CONFIG_PATH,
) -> dict[str, object]:
    """A ConfigMap holding every ``hosts.toml`` for ``registries``. ConfigMap keys cannot
    hold ``/``, so each key is ``<registry with ':' as '_'>.hosts.toml`` and the
    annotation ``preheat.dev/hosts-paths`` maps key -> the path containerd reads; a node
    bootstrap step (or a DaemonSet with a hostPath on ``config_path``) copies them there."""
    files = mirror_files(registries, mirror, config_path)
    data: dict[str, str] = {}
    paths: dict[str, str] = {}
    for path, body in files.items():
        registry = path[len(config_path.rstrip("/")) + 1 : -len("/hosts.toml")]
        key = registry.replace(":", "_").strip("[]") + ".hosts.toml"
        data[key] = body
        paths[key] = path
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "preheat", "app.kubernetes.io/component": "agent"},
            "annotations": {
                "preheat.dev/hosts-paths": ", ".join(f"{k}={v}" for k, v in sorted(paths.items()))
            },
        },
        "data": data,
    }
