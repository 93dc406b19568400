"""The engine container's command line and the ports it publishes (pure: no I/O).

:func:`engine_argv` writes the endpoint's engine template out for a pod (``{snapshot}``
the pod-local snapshot, ``{port}`` :data:`ENGINE_PORT`, ``{host}`` ``$(POD_IP)``,
``{model}``, ``{replica}`` ``$(POD_NAME)``); :func:`kv_event_ports` reads from it the
KV-event publisher's ports (``kv-events``, ``kv-replay``) that the pod and the variant's
Service carry (``workload.py``).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence

from preheat.control.spec_types import CommandEngine, VariantSpec

__all__ = ["ENGINE_PORT", "SNAPSHOT_PATH", "WEIGHTS_MOUNT", "engine_argv", "kv_event_ports"]

#: The pod-local directory the init container fills (a link or a pulled copy).
WEIGHTS_MOUNT = "/weights"
SNAPSHOT_PATH = f"{WEIGHTS_MOUNT}/model"
ENGINE_PORT = 8000


def engine_argv(v: VariantSpec, model: str) -> list[str]:
    """The engine container's command line (host ``$(POD_IP)``, the pod-local snapshot)."""
    if isinstance(v.engine, CommandEngine):
        text = v.engine.command.format(
            snapshot=SNAPSHOT_PATH,
            port=ENGINE_PORT,
            host="$(POD_IP)",
            model=shlex.quote(model),
            replica="$(POD_NAME)",
        )
        return shlex.split(text)
    e = v.engine
    argv = [
        "preheat", "engine", "serve", "--host", "$(POD_IP)", "--port", str(ENGINE_PORT),
        "--profile", e.profile, "--snapshot", SNAPSHOT_PATH,
        "--time-scale", str(e.time_scale), "--model-name", model,
    ]  # fmt: skip
    if e.kv_blocks is not None:
        argv += ["--kv-blocks", str(e.kv_blocks)]
    return argv


def _tcp_port(url: object) -> int | None:
    """The port of ``tcp://HOST:PORT[?...]`` (``HOST`` may be ``*`` or ``$(POD_IP)``)."""
    if not isinstance(url, str) or not url.startswith("tcp://"):
        return None
    _, _, port = url.split("?", 1)[0].removeprefix("tcp://").rstrip("/").rpartition(":")
    return int(port) if port.isdigit() and 0 < int(port) < 65536 else None


def _query(url: str, key: str) -> str | None:
    for part in url.partition("?")[2].split("&"):
        k, _, v = part.partition("=")
        if k == key:
            return v
    return None


def kv_event_ports(argv: Sequence[str]) -> list[tuple[str, int]]:
    """``[("kv-events", P), ("kv-replay", R)]`` for an engine command line that publishes
    KV events (module docstring); ``[]`` for one that does not or names no TCP port."""
    events = replay = None
    for i, arg in enumerate(argv):
        flag, eq, inline = arg.partition("=")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if flag == "--kv-events":
            events = _tcp_port(value)
            replay = _tcp_port(_query(value, "replay"))
        elif flag == "--kv-events-config":
            try:
                cfg = json.loads(value)
            except ValueError:
                continue
            if isinstance(cfg, dict) and cfg.get("enable_kv_cache_events", True):
                events = _tcp_port(cfg.get("endpoint"))
                replay = _tcp_port(cfg.get("replay_endpoint"))
    if events is None:
        return []
    out = [("kv-events", events)]
    if replay is not None and replay != events:
        out.append(("kv-replay", replay))
    return out
