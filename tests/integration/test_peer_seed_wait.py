"""A receiver waits for a seed that is still filling, and goes to the origin only for
the pieces of a seed that stalls: real node stores, a real peer server over the seed's
store, an aiohttp origin on 127.0.0.1 whose first request for one piece hangs."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from preheat.bench.models import generate_model, write_http_manifest
from preheat.runtime.procs import free_port
from preheat.sources.peer import PeerClient, PeerFill, PeerList
from preheat.sources.pieces import PIECE_SIZE, PieceBook
from preheat.store import NodeStore
from preheat.store.peer_server import PeerServer

MiB = 1 << 20


class _Seeds:
    """The directory a fleet gives its receivers: seed ``a`` holds a piece once it has
    landed, and is filling the blob while its pull runs."""

    def __init__(self, store: NodeStore, server: PeerServer, seed: asyncio.Task[object]) -> None:
        self.store, self.server, self.seed = store, server, seed
        self.avoided: dict[str, str] = {}

    def candidates(self, digest: str, index: int, receiver: str) -> list[tuple[str, str]]:
        partial = self.server.book.get(digest)
        held = self.store.layout.blob(digest).exists()
        if held or (partial is not None and index in partial.verified):
            return [("a", self.server.url)]
        return []

    def seed_progress(self, digest: str, receiver: str) -> dict[str, int]:
        if self.seed.done() or self.store.layout.blob(digest).exists():
            return {}
        partial = self.server.book.get(digest)
        return {"a": len(partial.verified) if partial is not None else 0}

    def avoid(self, peer: str, why: str) -> None:
        self.avoided[peer] = why


async def _origin(
    root: Path, hang: Callable[[web.Request], bool]
) -> tuple[web.AppRunner, str, list[str]]:
    """Static files with Range; a request ``hang`` picks waits (up to 20 s) instead."""
    seen: list[str] = []

    @web.middleware
    async def stall(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        seen.append(request.headers.get("Range", ""))
        if hang(request):
            await asyncio.sleep(20)
        return await handler(request)

    app = web.Application(middlewares=[stall])
    app.router.add_static("/", root)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", seen


async def test_a_stalled_seed_costs_its_missing_piece_from_the_origin(tmp_path: Path) -> None:
    """Seed a's request for piece 1 hangs; receiver b takes pieces 0 and 2 from a as they
    land, waits for piece 1 while a makes progress, then (a stalled past ``seed_stall``)
    fetches it from the origin: b ends with the verified blob, one stall counted, and the
    origin sent b only that piece."""
    root = tmp_path / "origin"
    (shard,) = [
        p
        for p in generate_model(root / "m", 2 * PIECE_SIZE + 4 * MiB, 1, seed=21)
        if p.suffix == ".safetensors"
    ]
    write_http_manifest(root / "m")
    size = shard.stat().st_size
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    piece1 = f"bytes={PIECE_SIZE}-"
    hung: list[str] = []

    def hang(request: web.Request) -> bool:
        if request.headers.get("Range", "").startswith(piece1) and not hung:
            hung.append(request.headers["Range"])
            return True
        return False

    runner, base, seen = await _origin(root, hang)
    token = secrets.token_urlsafe(24)
    ref = f"{base}/m/preheat-manifest.json"
    a = NodeStore(tmp_path / "a", retries=1, backoff=0.01)
    book = PieceBook()
    server = PeerServer(a.layout, token, book)
    await server.start()
    client = PeerClient(token)
    seed: asyncio.Task[object] | None = None
    try:
        fill_a = PeerFill(client, PeerList({}), "a", book)
        seed = asyncio.create_task(a.apull(ref, peers=fill_a, chunk=PIECE_SIZE))
        for _ in range(300):  # bounded: 30 s for pieces 0 and 2 to land on a
            partial = book.get(digest)
            if partial is not None and {0, 2} <= partial.verified:
                break
            await asyncio.sleep(0.1)
        assert hung and not seed.done()
        b = NodeStore(tmp_path / "b", retries=1, backoff=0.01)
        fill_b = PeerFill(
            client, _Seeds(a, server, seed), "b", PieceBook(), wait_for_seeds=True, seed_stall=1.0
        )
        before = len(seen)
        res = await asyncio.wait_for(b.apull(ref, peers=fill_b, chunk=PIECE_SIZE), 30)
    finally:
        if seed is not None:
            seed.cancel()
            await asyncio.gather(seed, return_exceptions=True)
        await client.aclose()
        await server.stop()
        await runner.cleanup()
    assert fill_b.seed_stalls == 1 and fill_b.bad_pieces == 0
    # every byte but piece 1 came from a (the shard's pieces 0 and 2, the small files)
    assert size - PIECE_SIZE <= fill_b.peer_bytes < size
    assert res.bytes_fetched == fill_b.peer_bytes + PIECE_SIZE
    # after b started, the origin was asked only for piece 1 (by b, or a's own retry)
    ranges = {r for r in seen[before:] if r}
    assert ranges == {f"bytes={PIECE_SIZE}-{2 * PIECE_SIZE - 1}"}, ranges
    assert hashlib.sha256(b.layout.blob(digest).read_bytes()).hexdigest() == digest


class _Gap:
    """Seed ``a`` (holding the blob already) as a receiver's directory reads it around the
    end of a's fill: "filling" for ``fill_s``, then, for ``gap_s``, neither filling nor
    holding (its slot read as freed before its last status), then holding the blob."""

    def __init__(self, url: str, fill_s: float, gap_s: float) -> None:
        self.url = url
        self.avoided: dict[str, str] = {}
        self.t0 = asyncio.get_running_loop().time()
        self.fill_s, self.gap_s = fill_s, gap_s

    def _phase(self) -> str:
        t = asyncio.get_running_loop().time() - self.t0
        return "filling" if t < self.fill_s else "gap" if t < self.fill_s + self.gap_s else "held"

    def candidates(self, digest: str, index: int, receiver: str) -> list[tuple[str, str]]:
        return [("a", self.url)] if self._phase() == "held" else []

    def seed_progress(self, digest: str, receiver: str) -> dict[str, int]:
        return {"a": 0} if self._phase() == "filling" else {}

    def avoid(self, peer: str, why: str) -> None:
        self.avoided[peer] = why


async def test_a_seed_missing_from_one_read_is_waited_for_not_replaced(tmp_path: Path) -> None:
    """A seed that leaves the directory for less than ``seed_gone`` seconds (a late read,
    not a loss) costs no origin byte: every piece comes from it once it shows as holder;
    and with ``seed_gone`` shorter than the gap the pieces go to the origin."""
    root = tmp_path / "origin"
    generate_model(root / "m", PIECE_SIZE + 2 * MiB, 1, seed=22)
    write_http_manifest(root / "m")
    runner, base, seen = await _origin(root, lambda _r: False)
    token = secrets.token_urlsafe(24)
    ref = f"{base}/m/preheat-manifest.json"
    a = NodeStore(tmp_path / "a", retries=1, backoff=0.01)
    book = PieceBook()
    server = PeerServer(a.layout, token, book)
    await server.start()
    client = PeerClient(token)
    results = {}
    try:
        await a.apull(ref, chunk=PIECE_SIZE)
        for name, grace in (("b", 2.0), ("c", 0.2)):
            fill = PeerFill(
                client, _Gap(server.url, 0.3, 0.6), name, PieceBook(),
                wait_for_seeds=True, seed_gone=grace,
            )  # fmt: skip
            before = len(seen)
            store = NodeStore(tmp_path / name, retries=1, backoff=0.01)
            res = await asyncio.wait_for(store.apull(ref, peers=fill, chunk=PIECE_SIZE), 30)
            results[name] = (fill, res, [r for r in seen[before:] if r])
    finally:
        await client.aclose()
        await server.stop()
        await runner.cleanup()
    fill_b, res_b, ranged_b = results["b"]
    assert res_b.bytes_fetched == fill_b.peer_bytes
    assert ranged_b == [] and fill_b.peer_bytes > PIECE_SIZE and fill_b.seed_stalls == 0
    fill_c, res_c, ranged_c = results["c"]
    assert ranged_c and fill_c.peer_bytes < res_c.bytes_fetched
