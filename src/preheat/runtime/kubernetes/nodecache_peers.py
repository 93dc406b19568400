"""The peer side of ``NodeCache`` objects, from plain data (pure): what an agent says about
itself (``status.peer``: its peer URL and the blobs of the revisions it holds, bounded;
``status.warmups``: its last warm-ups with ``bytesFrom``) and what it reads about the
others (``peers_from_nodecaches``: who serves which blobs, who is filling)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from preheat.telemetry.records import WarmupRecord

__all__ = ["MAX_BLOBS", "MAX_WARMUPS", "PeerInfo", "peer_status", "peers_from_nodecaches"]

#: Blob digests listed in one NodeCache (digests of held revisions' files, never pieces).
MAX_BLOBS = 512
#: Finished warm-ups kept in ``status.warmups`` (the newest).
MAX_WARMUPS = 8


@dataclass(frozen=True)
class PeerInfo:
    """Another node's agent as its NodeCache says: where it serves, the blobs it holds
    complete, and whether it is filling a revision (it may serve verified pieces)."""

    name: str
    url: str
    blobs: frozenset[str]
    filling: bool


def peers_from_nodecaches(objs: Iterable[Mapping[str, Any]], me: str) -> dict[str, PeerInfo]:
    """name -> ``PeerInfo`` of every other node whose NodeCache has a peer URL."""
    out: dict[str, PeerInfo] = {}
    for o in objs:
        name = str((o.get("metadata") or {}).get("name") or "")
        status = o.get("status") or {}
        peer = status.get("peer") or {}
        url = peer.get("url")
        if not name or name == me or not isinstance(url, str) or not url:
            continue
        blobs = frozenset(b for b in peer.get("blobs") or () if isinstance(b, str))
        filling = any(r.get("state") == "Filling" for r in status.get("revisions") or ())
        out[name] = PeerInfo(name, url.rstrip("/"), blobs, filling)
    return out


def peer_status(url: str, blobs: Iterable[str], warmups: Iterable[WarmupRecord]) -> dict[str, Any]:
    """``status.peer`` and ``status.warmups`` of this node (bounded, sorted: a status that
    did not change compares equal and is not written)."""
    listed = sorted(set(blobs))[:MAX_BLOBS]
    recent = list(warmups)[-MAX_WARMUPS:]
    return {
        "peer": {"url": url, "blobs": listed},
        "warmups": [
            {
                "revision": w.revision,
                "mode": w.mode,
                "seconds": round(w.seconds, 3),
                "bytesFrom": {k: int(w.bytes_from.get(k, 0)) for k in ("origin", "peer", "cache")},
            }
            for w in recent
        ],
    }
