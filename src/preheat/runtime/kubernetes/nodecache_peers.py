"""The peer side of ``NodeCache`` objects, from plain data (pure): what an agent says about
itself (``status.peer``: its peer URL, the blobs it holds complete, and the progress of
the blobs it is filling, bounded; ``status.warmups``: its last warm-ups with
``bytesFrom``) and what it reads about the others (``peers_from_nodecaches``: who serves
which blobs, who is filling and which pieces it has verified; ``NodeCacheView``: the
``sources.peer.SeedDirectory`` a warm-up's ``PeerFill`` asks).

Fill progress (``status.peer.filling``, one entry per blob in progress): ``blob``, its
``pieces``, how many have ``landed`` (verified) and ``verified`` as index ranges
(``"0-11,13"``). At most ``MAX_FILLING`` entries and ``MAX_RANGES`` ranges per entry
(the pieces past them are left out, never invented; ``landed`` stays exact), so the
field stays small; the agent writes it at most every ``PeerConfig.progress_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from preheat.control.fanout import Candidate, rank_peers
from preheat.telemetry.records import WarmupRecord

__all__ = [
    "MAX_BLOBS",
    "MAX_FILLING",
    "MAX_RANGES",
    "MAX_WARMUPS",
    "FillProgress",
    "NodeCacheView",
    "PeerInfo",
    "parse_ranges",
    "peer_status",
    "peers_from_nodecaches",
    "piece_ranges",
]

#: Blob digests listed in one NodeCache (digests of held revisions' files, never pieces).
MAX_BLOBS = 512
#: Finished warm-ups kept in ``status.warmups`` (the newest).
MAX_WARMUPS = 8
#: Blobs in progress listed in ``status.peer.filling``, and index ranges per blob.
MAX_FILLING = 32
MAX_RANGES = 32


@dataclass(frozen=True)
class FillProgress:
    """A blob a node is filling: its piece count, pieces landed, and which (as listed)."""

    pieces: int
    landed: int
    verified: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PeerInfo:
    """Another node's agent as its NodeCache says: where it serves, the blobs it holds
    complete, whether it is filling a revision, and its fills' progress per blob."""

    name: str
    url: str
    blobs: frozenset[str]
    filling: bool
    progress: Mapping[str, FillProgress] = field(default_factory=dict)


def piece_ranges(indices: Iterable[int], limit: int = MAX_RANGES) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the first ``limit`` ranges)."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(indices)):
        if run and i == run[1] + 1:
            run[1] = i
            continue
        if run:
            out.append(f"{run[0]}" if run[0] == run[1] else f"{run[0]}-{run[1]}")
        run = [i, i]
    if run:
        out.append(f"{run[0]}" if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(out[:limit])


def parse_ranges(text: Any, pieces: int) -> frozenset[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}``, indices below ``pieces`` only; anything that is not
    such a list (another writer, a bad value) reads as nothing verified."""
    if not isinstance(text, str) or not text:
        return frozenset()
    out: set[int] = set()
    for part in text.split(",")[:MAX_RANGES]:
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            return frozenset()
        first, last = int(lo), int(hi or lo)
        out.update(range(first, min(last, pieces - 1) + 1))
    return frozenset(out)


def _progress(entries: Any) -> dict[str, FillProgress]:
    out: dict[str, FillProgress] = {}
    for e in entries if isinstance(entries, list) else ():
        if not isinstance(e, Mapping) or not isinstance(e.get("blob"), str):
            continue
        pieces, landed = e.get("pieces"), e.get("landed")
        if not isinstance(pieces, int) or not isinstance(landed, int) or pieces < 1:
            continue
        out[e["blob"]] = FillProgress(pieces, landed, parse_ranges(e.get("verified"), pieces))
    return out


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
        progress = _progress(peer.get("filling"))
        out[name] = PeerInfo(name, url.rstrip("/"), blobs, filling, progress)
    return out


def peer_status(
    url: str,
    blobs: Iterable[str],
    warmups: Iterable[WarmupRecord],
    filling: Mapping[str, FillProgress] | None = None,
) -> dict[str, Any]:
    """``status.peer`` and ``status.warmups`` of this node (bounded, sorted: a status that
    did not change compares equal and is not written)."""
    listed = sorted(set(blobs))[:MAX_BLOBS]
    recent = list(warmups)[-MAX_WARMUPS:]
    # always written, [] when idle: a merge patch leaves a key it does not name as it was
    progress = []
    for d, p in sorted((filling or {}).items())[:MAX_FILLING]:
        entry: dict[str, Any] = {"blob": d, "pieces": p.pieces, "landed": p.landed}
        if p.verified:  # the API server reads an empty string as null: left out
            entry["verified"] = piece_ranges(p.verified)
        progress.append(entry)
    return {
        "peer": {"url": url, "blobs": listed, "filling": progress},
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


class NodeCacheView:
    """The ``sources.peer.SeedDirectory`` over the other agents' NodeCaches as last read
    (``peers``) and the seeds of this warm-up (``seeds``: node -> the blobs its origin
    fill of the revision fetches, from the origin slot Leases); the agent refreshes both
    while a warm-up waits or fills. Complete holders of a blob come first, then agents
    whose published progress lists the piece verified."""

    def __init__(self) -> None:
        self.peers: dict[str, PeerInfo] = {}
        self.seeds: dict[str, frozenset[str]] = {}
        #: peer -> why it is avoided (it served bytes that failed verification).
        self.avoided: dict[str, str] = {}
        #: called once per newly avoided peer with (peer, why), e.g. to log it.
        self.on_avoid: Callable[[str, str], None] | None = None

    def complete(self, digests: frozenset[str]) -> dict[str, frozenset[str]]:
        """node -> which of ``digests`` it holds complete (for ``plan_fanout``)."""
        return {n: p.blobs & digests for n, p in self.peers.items() if n not in self.avoided}

    def filling(self, me: str) -> dict[str, frozenset[str]]:
        """node -> the blobs its origin fill fetches (``plan_fanout``'s ``filling``)."""
        return {n: b for n, b in self.seeds.items() if n != me and n not in self.avoided}

    def candidates(self, digest: str, index: int, receiver: str) -> list[tuple[str, str]]:
        others = [p for n, p in self.peers.items() if n != receiver]
        full = [Candidate(p.name) for p in others if digest in p.blobs]
        # a filling peer only for the pieces it lists verified: asking one for a piece it
        # lacks gets a 404, and the fill would give up on that peer for the whole blob
        part = [
            Candidate(p.name, complete=False)
            for p in others
            if (prog := p.progress.get(digest)) is not None and index in prog.verified
        ]
        key, avoid = f"{digest}:{index}", frozenset(self.avoided)
        ranked = rank_peers(full, key, avoid)
        ranked += tuple(n for n in rank_peers(part, key, avoid) if n not in ranked)
        return [(n, self.peers[n].url) for n in ranked]

    def seed_progress(self, digest: str, receiver: str) -> dict[str, int]:
        """Seeds (not ``receiver``) filling ``digest`` now, not yet holding it complete,
        each with its pieces landed as it last published them."""
        out: dict[str, int] = {}
        for name, blobs in self.filling(receiver).items():
            p = self.peers.get(name)
            if digest not in blobs or (p is not None and digest in p.blobs):
                continue
            prog = p.progress.get(digest) if p is not None else None
            out[name] = prog.landed if prog is not None else 0
        return out

    def avoid(self, peer: str, why: str) -> None:
        if peer not in self.avoided:
            self.avoided[peer] = why
            if self.on_avoid is not None:
                self.on_avoid(peer, why)
