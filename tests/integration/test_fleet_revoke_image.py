"""A revoked image digest on the fleet's list: replicas roll to ``image.fallback`` under
load, or, with none, keep serving and are reported (real registry, stores, router)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from preheat.errors import SnapshotNotFound
from preheat.images.cache import ImageCache
from preheat.runtime.local import LocalFleet
from preheat.testing.fleet import cluster_spec, endpoint_spec, make_model, run_load
from preheat.testing.registry import registry, write_layout

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000
KiB = 1024


def _images_run(fleet: LocalFleet) -> set[str | None]:
    return {fleet.warmer.images.image_of(r) for r in fleet.state.live_replicas()}


def _spec(model_ref: str, image: Any) -> Any:
    return endpoint_spec(
        "chat",
        model_ref,
        replicas=2,
        max_replicas=3,
        image=image,
        modelCacheConfig={"weights": {"enabled": True}, "image": {"enabled": True}},
    )


async def test_revoked_image_rolls_to_image_fallback_under_load(tmp_path: Path) -> None:
    """Revoking the image digest the replicas run rolls them to the spec's image fallback
    with no failed request; the revoked image leaves both stores once unused; a node
    that joins then, running no replica, is pre-pulled the fallback (what they run)."""
    model = make_model(tmp_path / "origin" / "m1", size=2 * MB, shards=2, seed=5)
    new = write_layout(tmp_path / "new", [128 * KiB, 64 * KiB], seed=1)
    old = write_layout(tmp_path / "old", [128 * KiB, 64 * KiB], seed=2)
    with registry(tmp_path / "reg") as reg:
        reg.push(new.path, "team/app:v2")
        reg.push(old.path, "team/app:v1")
        v2, v1 = reg.ref("team/app:v2"), reg.ref("team/app:v1")
        digest = new.images["linux/amd64"].manifest
        spec = _spec(model.ref, {"ref": v2, "fallback": [v1]})
        cluster = cluster_spec(tmp_path, ["a", "b"], slots=2)
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            images = fleet.warmer.images
            await fleet.wait_until(
                lambda f: f.ready_count() == 2 and images.holds("a", v2) and images.holds("b", v2),
                60,
                "two replicas and the image on both nodes",
            )
            assert _images_run(fleet) == {v2}
            stop = asyncio.Event()
            load = asyncio.create_task(
                run_load(fleet.router.url, requests=1500, concurrency=4, timeout=60, stop=stop)
            )
            await asyncio.sleep(0.3)
            await fleet.revoke(digest, "CVE-2026-0002 in the base layer")

            def gone(f: LocalFleet) -> bool:
                caches = [ImageCache(n.cache.store) for n in f.nodes.values()]
                return not any(i.digest == digest for c in caches for i in c.images())

            await fleet.wait_until(
                lambda f: f.ready_count() == 2 and _images_run(f) == {v1} and gone(f),
                60,
                "roll to the image fallback and removal of the revoked image",
            )
            stop.set()
            result = await load
            assert result.ok > 20 and result.failed == 0, result.errors[:5]
            v = fleet.status()["variants"][0]
            assert "image" in (v["revoked"] or "") and "rolling to fallback" in v["revoked"], v
            running = {r.node for r in fleet.state.live_replicas()}
            for name, node in fleet.nodes.items():
                with pytest.raises(SnapshotNotFound):
                    ImageCache(node.cache.store).find(f"{v2.rsplit(':', 1)[0]}@{digest}")
                if name in running:  # the fallback is referenced where a replica runs it
                    assert ImageCache(node.cache.store).find(v1).references == ("chat",)
            # A node that joins now runs no replica, and is pre-pulled the image they run.
            await fleet.add_node("c")
            await fleet.wait_until(lambda f: images.holds("c", v1), 30, "the fallback on c")
            assert "c" not in {r.node for r in fleet.state.live_replicas()}
            assert not images.holds("c", v2)
            # Unrevoke: the spec's own image comes back.
            await fleet.unrevoke(digest)
            await fleet.wait_until(
                lambda f: f.ready_count() == 2 and _images_run(f) == {v2},
                60,
                "roll back to the spec's image after unrevoke",
            )
            assert fleet.status()["variants"][0]["revoked"] is None


async def test_revoked_image_without_fallback_keeps_serving_and_reports(tmp_path: Path) -> None:
    """No image fallback: the replicas keep serving, no new one starts (a scale-out waits),
    and the variant says Revoked, naming image.fallback."""
    model = make_model(tmp_path / "origin" / "m1", size=2 * MB, shards=2, seed=6)
    layout = write_layout(tmp_path / "l", [128 * KiB], seed=3)
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/app:v1")
        image = reg.ref("team/app:v1")
        spec = _spec(model.ref, image)
        cluster = cluster_spec(tmp_path, ["a", "b"], slots=2)
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
            ids = {r.id for r in fleet.state.live_replicas()}
            await fleet.revoke(layout.images["linux/amd64"].manifest, "withdrawn")
            await fleet.wait_until(
                lambda f: bool(f.status()["variants"][0]["revoked"]), 30, "Revoked reported"
            )
            assert "image.fallback" in fleet.status()["variants"][0]["revoked"]
            await fleet.scale(3)
            for _ in range(8):  # several reconcile ticks: nothing new starts
                await asyncio.sleep(0.25)
                assert {r.id for r in fleet.state.live_replicas()} == ids
            result = await run_load(fleet.router.url, requests=40, concurrency=4, timeout=30)
            assert result.ok == 40 and result.failed == 0, result.errors[:5]
