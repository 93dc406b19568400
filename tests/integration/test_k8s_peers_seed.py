"""A node filling from the origin serves the pieces that landed before its blob is
published (the seed of a fan-out, local fleet and node agents alike), with nginx as a
slow origin and a second store pulling from the seed while it fills."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from pathlib import Path

import aiohttp

from preheat.bench.models import generate_model, write_http_manifest
from preheat.sources.peer import PeerClient, PeerFill, PeerList
from preheat.sources.pieces import PIECE_SIZE, PieceBook, blob_path
from preheat.store import NodeStore
from preheat.store.peer_server import PeerServer
from preheat.testing.origins import nginx_origin

MiB = 1 << 20


async def test_origin_fill_serves_landed_pieces_before_it_publishes(tmp_path: Path) -> None:
    """While node a fills a 40 MiB blob from a 4 MiB/s-per-connection origin, its peer
    server lists the landed pieces and serves them (206, the origin's bytes) with the blob
    not yet published; node b pulling meanwhile takes those pieces from a, the rest from
    the origin, and both stores end with the verified blob."""
    root = tmp_path / "origin"
    (shard,) = [
        p for p in generate_model(root / "m", 40 * MiB, 1, seed=9) if p.suffix == ".safetensors"
    ]
    write_http_manifest(root / "m")
    data = shard.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    token = secrets.token_urlsafe(24)
    with nginx_origin(root, limit_rate=4 * MiB) as origin:
        ref = origin.url("m/preheat-manifest.json")
        a = NodeStore(tmp_path / "a", retries=2, backoff=0.01)
        book = PieceBook()
        server = PeerServer(a.layout, token, book)
        await server.start()
        client = PeerClient(token)
        try:
            fill_a = PeerFill(client, PeerList({}), "a", book)
            seed = asyncio.create_task(a.apull(ref, peers=fill_a, chunk=PIECE_SIZE))
            auth = {"Authorization": f"Bearer {token}"}
            url = f"{server.url}{blob_path(digest)}"
            async with aiohttp.ClientSession() as s:
                listed: dict[str, object] = {}
                for _ in range(400):  # bounded: 40 s
                    async with s.get(f"{url}/pieces", headers=auth) as r:
                        listed = await r.json() if r.status == 200 else {}
                    if listed.get("have"):
                        break
                    await asyncio.sleep(0.1)
                assert not a.layout.blob(digest).exists(), "published before a piece was seen"
                assert listed["complete"] is False, listed
                have = listed["have"]
                assert isinstance(have, list) and have
                i = int(have[0])
                start, end = i * PIECE_SIZE, min(len(data), (i + 1) * PIECE_SIZE)
                async with s.get(url, headers={**auth, "Range": f"bytes={start}-{end - 1}"}) as r:
                    assert r.status == 206 and await r.read() == data[start:end]
            b = NodeStore(tmp_path / "b", retries=2, backoff=0.01)
            fill_b = PeerFill(client, PeerList({"a": server.url}), "b", PieceBook())
            res_b = await b.apull(ref, peers=fill_b, chunk=PIECE_SIZE)
            await seed
        finally:
            await client.aclose()
            await server.stop()
    assert fill_b.peer_bytes >= end - start and fill_b.bad_pieces == 0
    assert res_b.bytes_fetched + res_b.bytes_reused >= len(data)
    for store in (a, b):
        assert hashlib.sha256(store.layout.blob(digest).read_bytes()).hexdigest() == digest
        assert store.verify(quarantine=False).ok
