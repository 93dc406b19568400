"""The ``preheat`` command: a thin layer that parses options and calls library functions.

Each command group lives in its own module under ``preheat.cli`` and is loaded only when
used, so ``preheat --help`` stays fast and one broken integration cannot break the rest.
"""

from __future__ import annotations

import importlib
import importlib.util

import click

# command name -> "module:attribute" of a click command or group.
COMMANDS: dict[str, str] = {
    "cache": "preheat.cli.cache:cache",
    "engine": "preheat.cli.engine:engine",
    "router": "preheat.cli.router:router",
    "up": "preheat.cli.fleet:up",
    "status": "preheat.cli.fleet:status",
    "scale": "preheat.cli.fleet:scale",
    "apply": "preheat.cli.fleet:apply",
    "down": "preheat.cli.fleet:down",
    "node": "preheat.cli.fleet:node",
    # revoke: the fleet's cluster-wide revocation list
    "revoke": "preheat.cli.revoke:revoke",
    "unrevoke": "preheat.cli.revoke:unrevoke",
    "demo": "preheat.cli.demo:demo",
    "report": "preheat.cli.report:report",
    "k8s": "preheat.cli.k8s:k8s",
    "agent": "preheat.cli.agent:agent",
    # images (issue 11): the node image cache
    "image": "preheat.cli.image:image",
    # sim: the fleet simulator (routing; coldstart joins the same group)
    "sim": "preheat.cli.sim:sim",
    # operator (issue 10): the Kubernetes operator and its pods' init container
    "operator": "preheat.cli.operator:operator",
    "snapshot-init": "preheat.cli.operator:snapshot_init",
    # k8sops (issue 10): the External metrics API the rendered HPAs read
    "metrics-adapter": "preheat.cli.metrics_adapter:metrics_adapter",
}


def _available() -> dict[str, str]:
    out = {}
    for name, target in COMMANDS.items():
        module = target.split(":", 1)[0]
        if importlib.util.find_spec(module) is not None:
            out[name] = target
    return out


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_available())

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _available().get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":", 1)
        cmd = getattr(importlib.import_module(module), attr)
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{target} is not a click command")
        return cmd


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="preheat")
def main() -> None:
    """preheat keeps large-model inference warm.

    \b
    Model cache:  stage weights on each node's disk before a replica needs them
                  (preheat cache ...).
    Routing:      send requests that share a prompt prefix to the instance that
                  already holds it in its KV cache (preheat router ...).
    Local fleet:  preheat up / status / scale / apply / down, and preheat demo.
    """
