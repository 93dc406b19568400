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
  missing blob has a complete holder, or a *seed* fetches it: an agent holding an origin
  slot Lease for the revision), ``origin`` (an origin slot Lease was won,
  ``agent_peers_slots``) or wait. An origin fill writes its NodeCache status (the blobs
  it now serves) before it frees its slot. With ``peers: {enabled: false}`` the same
  Leases admit every fill (holders are not peers: only a won slot admits), so the
  cluster's origin budget holds without peers too (as ``runtime.peering.OriginGate`` in
  the local fleet).
- **Without peer flags** (``OriginOnly``, what ``preheat agent`` passes then): no peer
  server and no peer fills, but the same settings and, when ``origin.budget.
  concurrentFills`` is set, the same origin slot Leases admit each warm-up, so the
  cluster's budget holds for every agent (without a budget it fills at once, as before);
  its NodeCache gets no ``status.peer``.
- **Room**: once admitted, a warm-up's fill evicts no other warm-up's copy no pod has
  used yet (its ``spare``: ``agent_warmups.Warmups.room``, ``NodeStore.apull``).
- **Seeds** (as in local mode, ``runtime.peering``): every fill publishes its progress
  in ``status.peer.filling`` (pieces landed per blob, bounded, at most every
  ``progress_s``) and lists the blobs it has published; a ``peer`` fill re-reads the
  NodeCaches and slots every ``poll_s`` and waits in ``PeerFill`` for the seed's
  pieces, going to the origin for a piece only when the seeds land nothing for
  ``seed_stall`` seconds or none is left for ``2 * poll_s + 1`` seconds (its slot Lease
  expired: it stopped filling; a shorter gap is a late renewal or read).
- **Telemetry**: a ``WarmupRecord`` per warm-up (``bytes_from`` origin/peer/cache) in
  ``status.warmups`` and ``/metrics`` (``preheat_warmup_bytes{node,revision,source}``,
  and the peer part of ``preheat_agent_bytes_fetched_total{source}``, ``agent_metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preheat.control.fanout import (
    Budget,
    Mode,
    Slot,
    WarmRequest,
    origin_slot_names,
    pick_slot,
    plan_fanout,
    slot_holders,
)
from preheat.runtime.kubernetes.agent_config import describe_error
from preheat.runtime.kubernetes.agent_metrics import fetched_bytes
from preheat.runtime.kubernetes.agent_peers_config import PeerConfig, PeerSettings, read_token
from preheat.runtime.kubernetes.agent_peers_slots import OriginSlots
from preheat.runtime.kubernetes.agent_settings import PeerSettingsReader
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_peers import (
    FillProgress,
    NodeCacheView,
    peer_status,
    peers_from_nodecaches,
)
from preheat.runtime.peering import resolve_blobs
from preheat.sources.peer import PeerClient, PeerFill
from preheat.sources.pieces import PIECE_SIZE, PieceBook
from preheat.store import NodeStore
from preheat.store.fill import RateLimiter
from preheat.store.peer_server import PeerServer
from preheat.store.results import PullResult
from preheat.telemetry.records import WarmupRecord
from preheat.telemetry.warmups import WarmupCollector

__all__ = ["AgentPeers", "NodeCachePeers", "OriginOnly"]

log = logging.getLogger("preheat.agent")


@dataclass(frozen=True)
class OriginOnly(PeerConfig):
    """An agent started without ``--peer-port``: it serves and uses no peers, and keeps to
    the cluster's origin budget (module docstring; ``namespace``: of the settings and the
    slot Leases)."""

    token_file: Path = Path(os.devnull)  # no token: nothing is served or fetched from peers


class NodeCachePeers(NodeCacheView):
    """The ``NodeCacheView`` of this agent's warm-ups, read from the API (``refresh`` lists
    the NodeCaches; blocking: run it in a thread)."""

    def __init__(self, custom: Any, me: str) -> None:
        super().__init__()
        self.custom = custom
        self.me = me
        self.on_avoid = lambda peer, why: log.warning("avoiding peer %s: %s", peer, why)

    def refresh(self) -> None:
        listed = self.custom.list_cluster_custom_object(GROUP, VERSION, "nodecaches")
        self.peers = peers_from_nodecaches(listed.get("items") or (), self.me)


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
        #: False for an ``OriginOnly`` agent: no server, no peer fills.
        self.serving = not isinstance(pcfg, OriginOnly)
        token = read_token(pcfg.token_file) if self.serving else ""
        self.book = PieceBook()
        self.server = (
            PeerServer(store.layout, token, self.book, host=pcfg.host, port=pcfg.port)
            if self.serving
            else None
        )
        self.client = PeerClient(token)
        del token
        self.directory = NodeCachePeers(client.CustomObjectsApi(api_client), node)
        self.settings_reader = PeerSettingsReader(
            self.core, client.CustomObjectsApi(api_client), pcfg, node
        )
        self.slots = OriginSlots(api_client, pcfg.namespace, pcfg.lease_seconds)
        #: revision -> its blobs, while this agent pulls it (published ones are listed).
        self._pulling: dict[str, frozenset[str]] = {}
        #: (node, revision) -> the last finished warm-up, and its origin bytes.
        self.records: dict[tuple[str, str], WarmupRecord] = {}
        self.origin_bytes: dict[tuple[str, str], int] = {}
        registry.register(WarmupCollector(lambda: self.records, lambda: self.origin_bytes))
        #: ``preheat_agent_bytes_fetched_total{source}``: told the peer part of each pull.
        self.fetched = fetched_bytes(registry)

    @property
    def url(self) -> str:
        return self.cfg.url or (self.server.url if self.server is not None else "")

    async def start(self) -> None:
        if self.server is None:
            log.info("no peers; warm-ups keep to the origin budget in %s", self.cfg.namespace)
            return
        await self.server.start()
        log.info("serving peers on %s", self.url)

    async def aclose(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.stop()
        await self.client.aclose()

    # --- status ---------------------------------------------------------------------

    def status_fields(self) -> dict[str, Any]:
        """``status.peer`` and ``status.warmups`` of this node's NodeCache: the blobs of
        held revisions and those a fill in progress has published already, and the
        progress of the blobs still filling (``nodecache_peers``); nothing for an
        ``OriginOnly`` agent."""
        if not self.serving:
            return {}
        layout = self.store.layout
        blobs = {d for ds in list(self._pulling.values()) for d in ds if layout.blob(d).exists()}
        for info in self.store.snapshots():
            with contextlib.suppress(Exception):
                blobs |= {f.sha256 for f in self.store.manifest(info.digest).files if f.sha256}
        filling = {
            d: FillProgress(n, len(verified), verified)
            for d, (n, verified) in self.book.progress().items()
            if d not in blobs
        }
        return peer_status(self.url, blobs, self.records.values(), filling)

    def settings(self) -> PeerSettings:
        """The ConfigMap's settings now (``agent_settings``: absent, the defaults; invalid,
        the last valid ones, said on the NodeCache and in an Event)."""
        return self.settings_reader.read()

    # --- warm-up --------------------------------------------------------------------

    async def pull(
        self,
        source: str,
        revision: str | None,
        progress: Callable[[int, int], None],
        publish: Callable[[], Any],
        on_wait: Callable[[str], None] = lambda _why: None,
        room: Callable[[str, str | None], Awaitable[frozenset[str]]] | None = None,
    ) -> PullResult:
        """Warm ``revision`` of ``source`` through the fan-out (see the module docstring);
        ``publish()`` writes this node's NodeCache status (blocking); ``room(source,
        revision)``, once admitted, says what the fill's eviction spares (``agent_warmups``)."""
        started = time.monotonic()
        settings = await asyncio.to_thread(self.settings)
        budget = settings.budget
        limiter = None
        if budget.bandwidth is not None:  # at most concurrentFills origin fills at once
            limiter = RateLimiter(budget.bandwidth / (budget.concurrent_fills or 1))
        rev, blobs = await resolve_blobs(source)
        rev = revision or rev
        me = f"{self.node}/{rev}"
        names = origin_slot_names(budget, rev)
        peers = settings.enabled and self.serving
        if self.serving or budget.concurrent_fills is not None:
            mode, slot = await self._admit(rev, blobs, names, budget, me, on_wait, peers=peers)
        else:  # an OriginOnly agent without a budget: nothing to keep to
            mode, slot = Mode.ORIGIN, None
        self._pulling[rev] = blobs  # its published blobs are listed while it fills
        # while it fills: the slot renewed, this node's progress published, and the view
        # of the others (holders, seeds' progress) kept fresh for the fill's pieces
        tasks = [asyncio.create_task(self._every(self.cfg.progress_s, publish))]
        if slot is not None:
            tasks.append(asyncio.create_task(self._renew(slot, me)))
        elif peers:
            look = functools.partial(self._look_sync, rev, blobs, names)
            tasks.append(asyncio.create_task(self._every(self.cfg.poll_s, look)))
        fill = PeerFill(
            self.client, self.directory, self.node, self.book,
            wait_for_seeds=mode is Mode.PEER, seed_stall=self.cfg.seed_stall,
            seed_gone=2 * self.cfg.poll_s + 1,
        )  # fmt: skip
        try:
            spare = frozenset() if room is None else await room(source, rev)
            res = await self.store.apull(
                source, revision=rev, progress=progress, peers=fill if peers else None,
                origin_limiter=limiter, chunk=PIECE_SIZE, rate_limit=settings.node_bandwidth,
                spare=spare,
            )  # fmt: skip
            self._record(res, mode, fill.peer_bytes, started)
            if fill.seed_stalls:
                log.warning("warm-up of %s: %d piece(s) from the origin after a stalled seed",
                            rev[:12], fill.seed_stalls)  # fmt: skip
            if slot is not None:  # others see the blobs before the slot frees
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(publish)
            return res
        finally:
            self._pulling.pop(rev, None)
            for task in tasks:
                task.cancel()
            if slot is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.slots.release, slot, me)

    @staticmethod
    async def _every(seconds: float, step: Callable[[], Any]) -> None:
        """``step()`` (blocking, in a thread) every ``seconds`` until cancelled."""
        while True:
            await asyncio.sleep(seconds)
            try:
                await asyncio.to_thread(step)
            except Exception as exc:  # the API server blinked: try again next period
                log.warning("peer status step failed: %s", describe_error(exc))

    def _look_sync(
        self, rev: str, blobs: frozenset[str], names: tuple[str, ...], with_peers: bool = True
    ) -> tuple[list[Slot], float]:
        """Read the other NodeCaches (``with_peers``) and the origin slots of ``rev``: the
        directory's holders and seeds (the live slot holders of ``rev``, with the blobs
        they fetch)."""
        if not with_peers:
            return self.slots.read(names), time.monotonic()
        # the slots first: a seed publishes its blobs before it frees its slot, so a seed
        # whose slot is read as held here has its final blobs in the NodeCaches read next
        slots = self.slots.read(names)
        self.directory.refresh()
        now = time.monotonic()
        peers = self.directory.peers
        self.directory.seeds = {
            n: blobs - (peers[n].blobs if n in peers else frozenset())
            for n, r in slot_holders(slots, now)
            if r == rev and n != self.node
        }
        return slots, now

    async def _admit(
        self,
        rev: str,
        blobs: frozenset[str],
        names: tuple[str, ...],
        budget: Budget,
        me: str,
        on_wait: Callable[[str], None],
        *,
        peers: bool = True,
    ) -> tuple[Mode, str | None]:
        """Wait for ``peer`` (every missing blob held, or fetched by a seed: an agent
        holding an origin slot for ``rev``) or a won origin slot; returns (mode, slot).
        Without ``peers`` (``peers: {enabled: false}``) only a won origin slot admits:
        holders are not peers, so the cluster's origin budget holds all the same."""
        layout = self.store.layout
        key = (self.node, rev)
        said = False
        while True:
            missing = frozenset(d for d in blobs if not layout.blob(d).exists())
            slots, now = await asyncio.to_thread(self._look_sync, rev, blobs, names, peers)
            running = slot_holders(slots, now)
            request = WarmRequest(self.node, rev, missing)
            complete = self.directory.complete(missing) if peers else {}
            seeds = self.directory.filling(self.node) if peers else {}
            plan = plan_fanout([request], complete, running, budget, seeds)
            if plan[key] is Mode.PEER:
                if seeds:
                    log.info("filling %s from peers, seeds %s", rev[:12], ", ".join(sorted(seeds)))
                return Mode.PEER, None
            if plan[key] is Mode.ORIGIN:
                slot = pick_slot(slots, me, now)
                if slot is not None and await asyncio.to_thread(self.slots.claim, slot, me):
                    log.info("origin slot %s for %s", slot.name, rev[:12])
                    return Mode.ORIGIN, slot.name
            why = f"waiting for an origin slot for {rev[:12]} ({len(running)} taken)"
            if peers:
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
