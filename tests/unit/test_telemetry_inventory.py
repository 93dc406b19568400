"""Cache inventory from a real NodeStore on disk: sizes, leases, pins, eviction order, JSON."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from preheat.bench.models import generate_model, rewrite_shard
from preheat.store.store import NodeStore
from preheat.telemetry.inventory import (
    NodeInventory,
    WarmupFailure,
    inventory_from_json,
    inventory_from_store,
    inventory_table,
    inventory_to_json,
)


@pytest.fixture
def store_with_two_revisions(tmp_path: Path) -> tuple[NodeStore, str, str]:
    """A store holding two revisions of a small model; v1 leased, v2 free to evict."""
    model = tmp_path / "model"
    generate_model(model, 256 * 1024, shards=4, seed=1)
    store = NodeStore(tmp_path / "store", capacity=64 * 1024**2, fsync=False)
    v1 = store.pull(f"file://{model}")
    rewrite_shard(model, 2, seed=9)
    v2 = store.pull(f"file://{model}")
    store.lease(v1.manifest_digest, "chat-main-0")
    store.set_priority(v1.manifest_digest, 5)
    return store, v1.manifest_digest, v2.manifest_digest


def test_inventory_reads_the_store(store_with_two_revisions: tuple[NodeStore, str, str]) -> None:
    """Sizes, leases, priority and eviction candidates are the store's own."""
    store, d1, d2 = store_with_two_revisions
    infos = {s.digest: s for s in store.snapshots()}
    failure = WarmupFailure("rev-x", "origin unreachable: connection refused", 1.7e9)
    inv = inventory_from_store(
        "node-a",
        store,
        capacity_bytes=store.capacity,
        ready={infos[d1].revisions[0]: True},
        last_warmup_failure=failure,
    )
    assert inv.node == "node-a"
    assert inv.free_bytes == store.free_bytes()
    by_digest = {s.manifest_digest: s for s in inv.snapshots}
    assert set(by_digest) == {d1, d2}
    assert by_digest[d1].size_bytes == infos[d1].size
    assert by_digest[d1].leased_by == ("chat-main-0",)
    assert by_digest[d1].priority == 5
    assert by_digest[d2].leased_by == ()
    assert inv.used_bytes == infos[d1].size + infos[d2].size
    # The leased snapshot is never an eviction candidate; the other one is first.
    assert inv.eviction_candidates == (by_digest[d2].revision,)
    assert inv.last_warmup_failure == failure
    assert inv.ready == {by_digest[d1].revision: True}


def test_inventory_json_round_trip_and_table(
    store_with_two_revisions: tuple[NodeStore, str, str],
) -> None:
    """JSON keeps every field; the rich table names node, revisions, leases and the failure."""
    store, _, _ = store_with_two_revisions
    inv = [
        inventory_from_store("node-a", store, capacity_bytes=store.capacity),
        NodeInventory(
            "node-b", free_bytes=0, last_warmup_failure=WarmupFailure("r", "disk full", 1.0)
        ),
    ]
    text = inventory_to_json(inv)
    back = inventory_from_json(text)
    assert back == inv
    console = Console(width=200, record=True)
    console.print(inventory_table(inv, now=2e9))
    out = console.export_text()
    assert "node-a" in out and "node-b" in out
    assert "chat-main-0" in out
    assert "disk full" in out
    assert "(empty)" in out
