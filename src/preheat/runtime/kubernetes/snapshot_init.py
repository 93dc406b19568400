"""``preheat snapshot-init``: the engine pod's init container.

Warm node: the node store (mounted read-only) holds the snapshot, so ``--out`` becomes a
symlink to it (no byte is fetched; the node agent leases the snapshot for the pod through
its ``preheat.dev/snapshot`` annotation). Cold node: the revision is pulled into a store
beside ``--out`` in the pod's own ``emptyDir`` and ``--out`` links to that snapshot: a
slower start, not a failed pod. With peers (``--peer-token-file`` and ``--peer`` URLs, or
the agents' NodeCaches) the cold pull takes its pieces from the node agents' peer servers
first (``sources.peer``, every byte verified) and the origin last. Either way the engine
reads ``--out``. The node store is only looked at (a directory per manifest digest),
never opened for writing.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preheat.sources.peer import PeerClient, PeerFill, PeerList
from preheat.sources.pieces import PIECE_SIZE, PieceBook
from preheat.store import NodeStore
from preheat.store.layout import Layout
from preheat.store.results import PullResult

__all__ = ["SnapshotInit", "peers_for", "prepare_snapshot"]


@dataclass(frozen=True)
class SnapshotInit:
    out: Path
    snapshot: Path
    warm: bool
    bytes_fetched: int
    #: Where the bytes came from: ``origin``, ``peer``, ``cache`` (the node's snapshot).
    bytes_from: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "out": str(self.out),
            "snapshot": str(self.snapshot),
            "warm": self.warm,
            "bytes_fetched": self.bytes_fetched,
            "bytes_from": self.bytes_from,
        }


def _link(out: Path, target: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, out)


def prepare_snapshot(
    *,
    store: Path,
    source: str,
    revision: str,
    digest: str | None,
    out: Path,
    peers: Mapping[str, str] | None = None,
    token: str | None = None,
) -> SnapshotInit:
    """Link ``out`` to the node's snapshot, or pull it into the pod (see module doc);
    ``peers`` (name -> peer server URL) with the cluster ``token``: pieces from them first."""
    if digest:
        node_snapshot = Layout(store).snapshot(digest.removeprefix("sha256:"))
        if node_snapshot.is_dir():
            _link(out, node_snapshot)
            return SnapshotInit(out, node_snapshot, True, 0, {"cache": _size(node_snapshot)})
    local = NodeStore(out.parent / "store")
    if peers and token:
        result, from_peers = asyncio.run(_pull_with_peers(local, source, revision, peers, token))
    else:
        result, from_peers = local.pull(source, revision=revision), 0
    _link(out, result.snapshot)
    bytes_from = {
        "origin": result.bytes_fetched - from_peers,
        "peer": from_peers,
        "cache": result.bytes_reused,
    }
    return SnapshotInit(
        out,
        result.snapshot,
        False,
        result.bytes_fetched,
        {k: v for k, v in bytes_from.items() if v},
    )


async def _pull_with_peers(
    local: NodeStore, source: str, revision: str, peers: Mapping[str, str], token: str
) -> tuple[PullResult, int]:
    client = PeerClient(token)
    try:
        fill = PeerFill(client, PeerList(dict(peers)), "snapshot-init", PieceBook())
        res = await local.apull(source, revision=revision, peers=fill, chunk=PIECE_SIZE)
        return res, fill.peer_bytes
    finally:
        await client.aclose()


def _size(snapshot: Path) -> int:
    return sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())


def peers_for(
    token_file: Path | None, urls: tuple[str, ...], from_nodecaches: bool
) -> tuple[str | None, dict[str, str]]:
    """The token and the peers (name -> URL) ``snapshot-init`` was pointed at: ``urls``
    as given, plus every agent's ``status.peer.url`` when ``from_nodecaches``.

    With only ``from_nodecaches`` (what the operator renders) nothing here fails the pod:
    no token file (the optional Secret is absent from the namespace) or NodeCaches that
    cannot be listed (no RBAC, API down) leave the pull to the origin, with one line on
    stderr saying why."""
    from preheat.errors import ConfigError
    from preheat.runtime.kubernetes.agent_peers_config import read_token

    if token_file is None:
        if urls or from_nodecaches:
            raise ConfigError("--peer and --peers-from-nodecaches need --peer-token-file")
        return None, {}
    if from_nodecaches and not urls and not token_file.exists():
        _note(f"no peer token at {token_file} (Secret preheat-peer-token absent): origin only")
        return None, {}
    token = read_token(token_file)
    peers = {f"peer-{i}": u.rstrip("/") for i, u in enumerate(urls)}
    if from_nodecaches:
        peers.update(_nodecache_peers())
    return token, peers


def _nodecache_peers() -> dict[str, str]:
    from kubernetes import client

    from preheat.runtime.kubernetes.agent_config import api_client_from, describe_error
    from preheat.runtime.kubernetes.crds import GROUP, VERSION
    from preheat.runtime.kubernetes.nodecache_peers import peers_from_nodecaches

    try:
        api = client.CustomObjectsApi(api_client_from(None))
        listed: Any = api.list_cluster_custom_object(GROUP, VERSION, "nodecaches")
    except Exception as exc:  # any failure: the origin still serves the pod
        _note(f"cannot list NodeCaches ({describe_error(exc)}): no agent peers, origin")
        return {}
    found = peers_from_nodecaches(listed.get("items") or (), me="")
    return {name: p.url for name, p in found.items()}


def _note(line: str) -> None:
    print(f"snapshot-init: {line}", file=sys.stderr, flush=True)


def dumps(result: SnapshotInit) -> str:
    return json.dumps(result.to_dict())
