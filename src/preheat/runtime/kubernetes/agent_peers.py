"""The node agent's peers (``preheat agent --peer-port P --peer-token-file F``).

- **Serves** its store to the other agents with ``store.peer_server.PeerServer`` on its
  own port (the cluster token from a Secret mounted as a file, held in memory only), and
  says where in its ``NodeCache`` status: ``status.peer.url`` and the blobs of the
  revisions it holds (``nodecache_peers.peer_status``).
- **Uses** them: a warm-up reads the other ``NodeCache`` objects (``NodeCachePeers``, the
  ``sources.peer.PeerDirectory``) and fills through the store's fill path with
  ``sources.peer.PeerFill``: pieces from peers that hold them, the origin last, every
  byte verified (piece digests, then the blob's sha256 against the manifest).
- **Admission** within the cluster-wide origin budget (``origin.budget`` in the
  ``preheat-settings`` ConfigMap): ``control.fanout.plan_fanout`` decides ``peer`` (every
  missing blob has a complete holder), ``origin`` (an origin slot Lease was won,
  ``agent_peers_slots``) or wait. An origin fill writes its NodeCache status (the blobs
  it now serves) before it frees its slot, so the waiting agents become ``peer``.
- **Telemetry**: a ``WarmupRecord`` per warm-up (``bytes_from`` origin/peer/cache) in
  ``status.warmups`` and ``/metrics`` (``preheat_warmup_bytes{node,revision,source}``,
  and the peer part of ``preheat_agent_bytes_fetched_total{source}``, ``agent_metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from preheat.control.fanout import (
    Budget,
    Candidate,
    Mode,
    WarmRequest,
    origin_slot_names,
    pick_slot,
    plan_fanout,
    rank_peers,
    slot_holders,
)
from preheat.runtime.kubernetes.agent_config import describe_error
from preheat.runtime.kubernetes.agent_metrics import fetched_bytes
from preheat.runtime.kubernetes.agent_peers_config import (
    SETTINGS_KEY,
    PeerConfig,
    PeerSettings,
    parse_settings,
    read_token,
)
from preheat.runtime.kubernetes.agent_peers_slots import OriginSlots
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_peers import PeerInfo, peer_status, peers_from_nodecaches
from preheat.runtime.peering import resolve_blobs
from preheat.sources.peer import PeerClient, PeerFill
from preheat.sources.pieces import PIECE_SIZE, PieceBook
from preheat.store import NodeStore
from preheat.store.fill import RateLimiter
from preheat.store.peer_server import PeerServer
from preheat.store.results import PullResult
from preheat.telemetry.records import WarmupRecord
from preheat.telemetry.warmups import WarmupCollector

__all__ = ["AgentPeers", "NodeCachePeers"]

log = logging.getLogger("preheat.agent")


class NodeCachePeers:
    """A ``PeerDirectory`` over the other agents' ``NodeCache`` objects (``refresh`` lists
    them; blocking): complete holders of a blob first, then agents that are filling (they
    serve verified pieces, else answer 416/404 and are skipped)."""

    def __init__(self, custom: Any, me: str) -> None:
        self.custom = custom
        self.me = me
        self.peers: dict[str, PeerInfo] = {}
        #: peer -> why it is avoided (it served bytes that failed verification).
        self.avoided: dict[str, str] = {}

    def refresh(self) -> None:
        listed = self.custom.list_cluster_custom_object(GROUP, VERSION, "nodecaches")
        self.peers = peers_from_nodecaches(listed.get("items") or (), self.me)

    def complete(self, digests: frozenset[str]) -> dict[str, frozenset[str]]:
        """node -> which of ``digests`` it holds complete (for ``plan_fanout``)."""
        return {n: p.blobs & digests for n, p in self.peers.items() if n not in self.avoided}

    def candidates(self, digest: str, index: int, receiver: str) -> list[tuple[str, str]]:
        others = [p for n, p in self.peers.items() if n != receiver]
        full = [Candidate(p.name) for p in others if digest in p.blobs]
        part = [Candidate(p.name, complete=False) for p in others if p.filling]
        key, avoid = f"{digest}:{index}", frozenset(self.avoided)
        ranked = rank_peers(full, key, avoid)
        ranked += tuple(n for n in rank_peers(part, key, avoid) if n not in ranked)
        return [(n, self.peers[n].url) for n in ranked]

    def avoid(self, peer: str, why: str) -> None:
        if peer not in self.avoided:
            self.avoided[peer] = why
            log.warning("avoiding peer %s: %s", peer, why)


class AgentPeers:
    """See the module docstring; owned by the ``NodeAgent`` (``start`` / ``aclose``)."""

    def __init__(
        self, node: str, pcfg: PeerConfig, store: NodeStore, api_client: Any, registry: Any
    ) -> None:
        from kubernetes import client

        self.node = node
        self.cfg = pcfg
        self.store = store
        self.core = client.CoreV1Api(api_client)
        token = read_token(pcfg.token_file)
        self.book = PieceBook()
        self.server = PeerServer(store.layout, token, self.book, host=pcfg.host, port=pcfg.port)
        self.client = PeerClient(token)
        del token
        self.directory = NodeCachePeers(client.CustomObjectsApi(api_client), node)
        self.slots = OriginSlots(api_client, pcfg.namespace, pcfg.lease_seconds)
        #: (node, revision) -> the last finished warm-up, and its origin bytes.
        self.records: dict[tuple[str, str], WarmupRecord] = {}
        self.origin_bytes: dict[tuple[str, str], int] = {}
        registry.register(WarmupCollector(lambda: self.records, lambda: self.origin_bytes))
        #: ``preheat_agent_bytes_fetched_total{source}``: told the peer part of each pull.
        self.fetched = fetched_bytes(registry)

    @property
    def url(self) -> str:
        return self.cfg.url or self.server.url

    async def start(self) -> None:
        await self.server.start()
        log.info("serving peers on %s", self.url)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.server.stop()
        await self.client.aclose()

    # --- status ---------------------------------------------------------------------

    def status_fields(self) -> dict[str, Any]:
        """``status.peer`` and ``status.warmups`` of this node's NodeCache."""
        blobs: set[str] = set()
        for info in self.store.snapshots():
            with contextlib.suppress(Exception):
                blobs |= {f.sha256 for f in self.store.manifest(info.digest).files if f.sha256}
        return peer_status(self.url, blobs, self.records.values())

    def settings(self) -> PeerSettings:
        """The ConfigMap's settings now (absent: the defaults; unreadable: said, defaults)."""
        from kubernetes.client.exceptions import ApiException

        try:
            cm = self.core.read_namespaced_config_map(self.cfg.settings, self.cfg.namespace)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("cannot read the peer settings: %s", describe_error(exc))
            return PeerSettings()
        return parse_settings((cm.data or {}).get(SETTINGS_KEY))

    # --- warm-up --------------------------------------------------------------------

    async def pull(
        self,
        source: str,
        revision: str | None,
        progress: Callable[[int, int], None],
        publish: Callable[[], Any],
        on_wait: Callable[[str], None] = lambda _why: None,
    ) -> PullResult:
        """Warm ``revision`` of ``source`` through the fan-out (see the module docstring);
        ``publish()`` writes this node's NodeCache status (blocking)."""
        started = time.monotonic()
        settings = await asyncio.to_thread(self.settings)
        budget = settings.budget
        limiter = None
        if budget.bandwidth is not None:  # at most concurrentFills origin fills at once
            limiter = RateLimiter(budget.bandwidth / (budget.concurrent_fills or 1))
        if not settings.enabled:
            res = await self.store.apull(
                source, revision=revision, progress=progress, origin_limiter=limiter,
                rate_limit=settings.node_bandwidth,
            )  # fmt: skip
            self._record(res, Mode.ORIGIN, 0, started)
            return res
        rev, blobs = await resolve_blobs(source)
        rev = revision or rev
        me = f"{self.node}/{rev}"
        mode, slot = await self._admit(rev, blobs, budget, me, on_wait)
        renewer = asyncio.create_task(self._renew(slot, me)) if slot else None
        fill = PeerFill(self.client, self.directory, self.node, self.book)
        try:
            res = await self.store.apull(
                source, revision=rev, progress=progress, peers=fill,
                origin_limiter=limiter, chunk=PIECE_SIZE, rate_limit=settings.node_bandwidth,
            )  # fmt: skip
            self._record(res, mode, fill.peer_bytes, started)
            if slot is not None:  # others see the blobs before the slot frees
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(publish)
            return res
        finally:
            if renewer is not None:
                renewer.cancel()
            if slot is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.slots.release, slot, me)

    async def _admit(
        self,
        rev: str,
        blobs: frozenset[str],
        budget: Budget,
        me: str,
        on_wait: Callable[[str], None],
    ) -> tuple[Mode, str | None]:
        """Wait for ``peer`` or a won origin slot; returns (mode, slot name or None)."""
        layout = self.store.layout
        key = (self.node, rev)
        names = origin_slot_names(budget, rev)
        said = False
        while True:
            missing = frozenset(d for d in blobs if not layout.blob(d).exists())
            await asyncio.to_thread(self.directory.refresh)
            slots = await asyncio.to_thread(self.slots.read, names)
            now = time.monotonic()
            running = slot_holders(slots, now)
            request = WarmRequest(self.node, rev, missing)
            plan = plan_fanout([request], self.directory.complete(missing), running, budget)
            if plan[key] is Mode.PEER:
                return Mode.PEER, None
            if plan[key] is Mode.ORIGIN:
                slot = pick_slot(slots, me, now)
                if slot is not None and await asyncio.to_thread(self.slots.claim, slot, me):
                    log.info("origin slot %s for %s", slot.name, rev[:12])
                    return Mode.ORIGIN, slot.name
            why = f"waiting for a peer to hold {rev[:12]} or an origin slot ({len(running)} taken)"
            on_wait(why)
            if not said:
                log.info("%s", why)
                said = True
            await asyncio.sleep(self.cfg.poll_s)

    async def _renew(self, name: str, me: str) -> None:
        while True:
            await asyncio.sleep(self.cfg.lease_seconds / 3)
            try:
                if not await asyncio.to_thread(self.slots.renew, name, me):
                    log.warning("origin slot %s was taken over while %s filled", name, me)
                    return
            except Exception as exc:  # the API server blinked: try again next period
                log.warning("renewing origin slot %s failed: %s", name, describe_error(exc))

    def _record(self, res: PullResult, mode: Mode, peer_bytes: int, started: float) -> None:
        origin = max(0, res.bytes_fetched - peer_bytes)
        kind = "cache" if res.bytes_fetched == 0 else mode.value
        bytes_from = {"origin": origin, "peer": peer_bytes, "cache": res.bytes_reused}
        key = (self.node, res.revision)
        self.records.pop(key, None)  # newest last
        self.records[key] = WarmupRecord(
            self.node, res.revision, time.monotonic() - started, kind,
            {k: v for k, v in bytes_from.items() if v},
        )  # fmt: skip
        self.origin_bytes[key] = self.origin_bytes.get(key, 0) + origin
        if self.fetched is not None:
            self.fetched.peer(peer_bytes)
        log.info("warm-up of %s: %s, %s", res.revision[:12], kind, bytes_from)
