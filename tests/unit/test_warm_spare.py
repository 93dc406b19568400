"""A warm-up's fill spares the warmed copies no replica has used, in the store's own
reservation (``NodeStore.pull(spare=...)``, ``store.space``); real stores and file://
models (the agent's side, and a restart: ``test_agent_warm_room``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.bench.models import generate_model
from preheat.errors import InsufficientSpace, WarmupDeferred
from preheat.runtime.warm_room import WarmCopies
from preheat.store import NodeStore

MB = 1_000_000


def _models(tmp_path: Path, *names: str, size: int = MB) -> list[str]:
    for i, name in enumerate(names):
        generate_model(tmp_path / name, size, shards=1, seed=i + 7)
    return [f"file://{tmp_path / n}" for n in names]


def _digests(store: NodeStore) -> set[str]:
    return {s.digest for s in store.snapshots()}


def test_a_warm_ups_reservation_spares_the_copy_when_another_fill_took_the_room(
    tmp_path: Path,
) -> None:
    """Room for three models holding W (warmed, unused, oldest) and O (used): a plain pull
    takes the free room after the warm-up chose what it spares, and the warm-up's own
    reservation then evicts O, never W; with nothing left but W it is deferred."""
    w, o, a, b, c = _models(tmp_path, "w", "o", "a", "b", "c")
    store = NodeStore(tmp_path / "store", capacity=3_500_000, fsync=False)
    copies = WarmCopies()
    wd = store.pull(w).manifest_digest
    copies.record("n0", store, wd)
    od = store.pull(o).manifest_digest
    store.lease(od, "replica-1")  # used, then released
    store.release(od, "replica-1")
    spare = copies.unused(store)
    assert spare == {wd}
    bd = store.pull(b).manifest_digest  # the other fill takes the free room
    ad = store.pull(a, spare=spare).manifest_digest
    assert _digests(store) == {wd, bd, ad}
    store.lease(bd, "replica-2")  # B and A are in use: only W could make room
    store.lease(ad, "replica-3")
    with pytest.raises(WarmupDeferred, match="1 warmed copy no replica has used yet") as exc:
        store.pull(c, spare=copies.unused(store))
    assert exc.value.evictable == 0 and exc.value.need > 0
    assert wd in _digests(store)
    store.pull(c)  # a replica's pull spares nothing: W goes
    assert wd not in _digests(store)


def test_a_fill_that_would_not_fit_even_evicting_spared_copies_is_insufficient_space(
    tmp_path: Path,
) -> None:
    """A warm-up larger than everything evictable, spared copies included, is refused with
    ``InsufficientSpace`` (unfit), not ``WarmupDeferred`` (retried)."""
    w, big = _models(tmp_path, "w", "big")
    generate_model(tmp_path / "big", 3 * MB, shards=1, seed=3)
    store = NodeStore(tmp_path / "store", capacity=2_000_000, fsync=False)
    wd = store.pull(w).manifest_digest
    WarmCopies().record("n0", store, wd)
    with pytest.raises(InsufficientSpace) as exc:
        store.pull(big, spare=WarmCopies().unused(store))
    assert not isinstance(exc.value, WarmupDeferred), exc.value
    assert _digests(store) == {wd}
