"""Peer blob servers and peer fills between real node stores, with nginx as the origin."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from preheat.bench.models import generate_model, write_http_manifest
from preheat.errors import DigestMismatch
from preheat.sources.peer import PeerClient, PeerFill, PeerList
from preheat.sources.pieces import PIECE_SIZE, PieceBook, blob_path
from preheat.store import NodeStore
from preheat.store.peer_server import PeerServer
from preheat.testing.origins import HttpOrigin, nginx_origin

MiB = 1 << 20


@pytest.fixture(scope="module")
def origin_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("origin")
    generate_model(root / "m", 40 * MiB, 3, seed=5)
    write_http_manifest(root / "m")
    return root


@pytest.fixture(scope="module")
def nginx(origin_root: Path) -> Iterator[HttpOrigin]:
    with nginx_origin(origin_root) as o:
        yield o


def _size(origin: HttpOrigin) -> int:
    return sum(
        p.stat().st_size for p in (origin.root / "m").iterdir() if p.name != "preheat-manifest.json"
    )


def _ref(nginx: HttpOrigin) -> str:
    return nginx.url("m/preheat-manifest.json")


def _tree(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _store(tmp_path: Path, name: str) -> NodeStore:
    return NodeStore(tmp_path / name, retries=2, backoff=0.01)


async def _seed(
    tmp_path: Path, nginx: HttpOrigin, name: str, token: str
) -> tuple[NodeStore, PeerServer]:
    store = _store(tmp_path, name)
    await store.apull(_ref(nginx), chunk=PIECE_SIZE)
    server = PeerServer(store.layout, token)
    await server.start()
    return store, server


def _blobs(store: NodeStore) -> list[Path]:
    return sorted(p for p in store.layout.blobs.glob("??/*"))


async def test_node_fills_every_byte_from_a_peer(tmp_path: Path, nginx: HttpOrigin) -> None:
    """A second node takes every blob from the first node's peer server, verified, and
    its snapshot is byte-identical to the origin's files."""
    token = secrets.token_urlsafe(24)
    a, server = await _seed(tmp_path, nginx, "a", token)
    client = PeerClient(token)
    try:
        fill = PeerFill(client, PeerList({"a": server.url}), "b", PieceBook())
        b = _store(tmp_path, "b")
        res = await b.apull(_ref(nginx), chunk=PIECE_SIZE, peers=fill)
        assert fill.peer_bytes == res.bytes_fetched == _size(nginx)
        assert server.bytes_served == _size(nginx)
        assert _tree(res.snapshot) == _tree(a.snapshot_path(res.revision))
    finally:
        await client.aclose()
        await server.stop()


async def test_without_peers_the_fill_is_todays(tmp_path: Path, nginx: HttpOrigin) -> None:
    """With no peer at all, a peer-aware pull fetches everything from the origin."""
    client = PeerClient(secrets.token_urlsafe(24))
    try:
        fill = PeerFill(client, PeerList({}), "b", PieceBook())
        res = await _store(tmp_path, "b").apull(_ref(nginx), chunk=PIECE_SIZE, peers=fill)
        assert res.bytes_fetched == _size(nginx) and fill.peer_bytes == 0
    finally:
        await client.aclose()


async def test_token_is_required_and_never_echoed(tmp_path: Path, nginx: HttpOrigin) -> None:
    """Without the cluster token (or with a wrong one) the peer server answers 401 and
    reveals nothing; with it, ranges are served; the token never appears in an answer."""
    token = secrets.token_urlsafe(24)
    a, server = await _seed(tmp_path, nginx, "a", token)
    digest = _blobs(a)[0].name
    url = f"{server.url}{blob_path(digest)}"
    try:
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer " + "x" * 32}, {"Authorization": token}):
                async with s.get(url, headers=headers) as r:
                    body = await r.read()
                    assert r.status == 401, headers
                    assert token.encode() not in body and digest.encode() not in body
            auth = {"Authorization": f"Bearer {token}", "Range": "bytes=10-19"}
            async with s.get(url, headers=auth) as r:
                body = await r.read()
                assert r.status == 206 and len(body) == 10
                assert token not in str(r.headers) and token.encode() not in body
            async with s.get(f"{server.url}/blobs/sha256:{'0' * 64}", headers=auth) as r:
                assert r.status == 404
        assert server.unauthorized == 3
    finally:
        await server.stop()


async def test_filling_node_serves_only_verified_pieces(tmp_path: Path) -> None:
    """A node still filling a blob serves ranges inside the pieces it verified against
    the piece list and refuses (416) any range that touches an unverified piece."""
    store = _store(tmp_path, "a")
    data = os.urandom(2 * PIECE_SIZE + 100)
    digest = hashlib.sha256(data).hexdigest()
    (store.layout.tmp / f"{digest}.part").write_bytes(data)
    pieces = tuple(
        hashlib.sha256(data[i : i + PIECE_SIZE]).hexdigest()
        for i in range(0, len(data), PIECE_SIZE)
    )
    book = PieceBook()
    book.start(digest, len(data), PIECE_SIZE, pieces)
    book.verified(digest, 1)
    token = secrets.token_urlsafe(24)
    server = PeerServer(store.layout, token, book)
    await server.start()
    url = f"{server.url}{blob_path(digest)}"
    auth = {"Authorization": f"Bearer {token}"}
    try:
        async with aiohttp.ClientSession() as s:
            inside = f"bytes={PIECE_SIZE}-{2 * PIECE_SIZE - 1}"
            async with s.get(url, headers={**auth, "Range": inside}) as r:
                assert r.status == 206 and await r.read() == data[PIECE_SIZE : 2 * PIECE_SIZE]
            for bad in (f"bytes=0-{PIECE_SIZE}", f"bytes={2 * PIECE_SIZE}-{2 * PIECE_SIZE + 5}"):
                async with s.get(url, headers={**auth, "Range": bad}) as r:
                    assert r.status == 416, bad
            async with s.get(f"{url}/pieces", headers=auth) as r:
                listed = await r.json()
            assert listed["complete"] is False and listed["have"] == [1]
            assert listed["digests"] == list(pieces)
    finally:
        await server.stop()


async def test_wrong_bytes_are_caught_and_the_peer_avoided(
    tmp_path: Path, nginx: HttpOrigin
) -> None:
    """A peer whose blob rotted on disk serves pieces that fail the piece list: they are
    fetched again from the good peer, the bad peer is avoided, the snapshot is exact."""
    token = secrets.token_urlsafe(24)
    a, good = await _seed(tmp_path, nginx, "a", token)
    c, bad = await _seed(tmp_path, nginx, "c", token)
    client = PeerClient(token)
    try:
        for blob in _blobs(c):  # c hands out the true piece list, then its bytes rot
            assert await client.piece_list(bad.url, blob.name) is not None
            os.chmod(blob, 0o644)
            with open(blob, "r+b") as f:
                f.seek(5)
                f.write(b"\xff\x00\xff")
        directory = PeerList({"a": good.url, "c": bad.url})
        fill = PeerFill(client, directory, "b", PieceBook())
        res = await _store(tmp_path, "b").apull(_ref(nginx), chunk=PIECE_SIZE, peers=fill)
        assert fill.bad_pieces >= 1 and "c" in directory.avoided
        # avoided at once: c sent at most the pieces already in flight when it was caught
        assert bad.bytes_served <= fill.bad_pieces * PIECE_SIZE
        assert fill.peer_bytes == _size(nginx)  # the rest came from the good peer
        assert _tree(res.snapshot) == _tree(a.snapshot_path(res.revision))
    finally:
        await client.aclose()
        await good.stop()
        await bad.stop()


async def test_lying_piece_list_fails_the_blob_digest_then_origin(
    tmp_path: Path, nginx: HttpOrigin
) -> None:
    """A peer whose piece list matches its wrong bytes passes the piece checks but not
    the blob's sha256: the pull fails that blob, the peer is avoided, the next pull
    takes the origin and is exact."""
    token = secrets.token_urlsafe(24)
    c, bad = await _seed(tmp_path, nginx, "c", token)
    for blob in _blobs(c):
        os.chmod(blob, 0o644)
        with open(blob, "r+b") as f:
            f.write(b"rotten")
    client = PeerClient(token)
    try:
        directory = PeerList({"c": bad.url})
        fill = PeerFill(client, directory, "b", PieceBook())
        b = _store(tmp_path, "b")
        with pytest.raises(DigestMismatch):
            await b.apull(_ref(nginx), chunk=PIECE_SIZE, peers=fill)
        assert "c" in directory.avoided
        again = PeerFill(client, directory, "b", PieceBook())
        res = await b.apull(_ref(nginx), chunk=PIECE_SIZE, peers=again)
        assert again.peer_bytes == 0
        assert res.bytes_fetched + res.bytes_reused == _size(nginx)
    finally:
        await client.aclose()
        await bad.stop()


async def test_peer_dying_mid_transfer_costs_a_retry(tmp_path: Path, nginx: HttpOrigin) -> None:
    """The only peer stops while a slow node is fetching from it: the pieces it did not
    deliver come from the origin and the pull succeeds, verified."""
    token = secrets.token_urlsafe(24)
    a, server = await _seed(tmp_path, nginx, "a", token)
    client = PeerClient(token)
    try:
        fill = PeerFill(client, PeerList({"a": server.url}), "b", PieceBook())
        b = _store(tmp_path, "b")
        pull = asyncio.create_task(
            b.apull(_ref(nginx), chunk=PIECE_SIZE, peers=fill, rate_limit=20 * MiB, connections=2)
        )
        while server.bytes_served < 6 * MiB:
            await asyncio.sleep(0.02)
        await server.stop()
        res = await asyncio.wait_for(pull, 60)
        assert fill.peer_failures >= 1
        assert 0 < fill.peer_bytes < _size(nginx)
        assert _tree(res.snapshot) == _tree(a.snapshot_path(res.revision))
    finally:
        await client.aclose()
        await server.stop()
