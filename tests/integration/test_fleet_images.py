"""The local fleet with ``modelCacheConfig.image.enabled`` against a real distribution
registry: pre-pulls into node stores, replica pulls, references, a registry that is down.

Images are two small layers pushed with skopeo; engines are simulated at time-scale 0.01.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from preheat.errors import ConfigError, SnapshotNotFound
from preheat.images.cache import ImageCache
from preheat.runtime.local import LocalFleet
from preheat.store.store import NodeStore
from preheat.telemetry.stats import stage_table, summarize_classes
from preheat.telemetry.tables import class_table
from preheat.testing.fleet import cluster_spec, endpoint_spec, make_model, start_records
from preheat.testing.registry import registry, write_layout

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000
KiB = 1024


def _spec(model_ref: str, image: str, *, replicas: int, weights: dict[str, Any]) -> Any:
    return endpoint_spec(
        "chat",
        model_ref,
        replicas=replicas,
        max_replicas=2,
        image=image,
        modelCacheConfig={"weights": weights, "image": {"enabled": True}},
    )


async def _until(fleet: LocalFleet, cond: Any, what: str, timeout: float = 60) -> None:
    await fleet.wait_until(lambda _fleet: cond(), timeout, what)


async def test_prepull_reference_replica_pull_and_cleanup(tmp_path: Path) -> None:
    """The target node pre-pulls the image (a replica there records ``cache``); a replica
    on a non-target node pulls it itself (``pull`` with ``image_ready``); both nodes hold
    it referenced by the endpoint; when the fleet stops the references go and the images
    stay, unreferenced, for the eviction policy."""
    model = make_model(tmp_path / "origin" / "m1", size=2 * MB, shards=2, seed=3)
    layout = write_layout(tmp_path / "layout", [256 * KiB, 128 * KiB])
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/app:v1")
        image = reg.ref("team/app:v1")
        spec = _spec(model.ref, image, replicas=0, weights={"enabled": True, "nodes": ["a"]})
        cluster = cluster_spec(tmp_path, ["a", "b"], slots=1)
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            images = fleet.warmer.images
            await _until(fleet, lambda: images.holds("a", image), "image pre-pulled on a")
            assert not images.holds("b", image)  # b is not a target: no pre-pull
            await fleet.scale(1)
            await _until(fleet, lambda: fleet.ready_count() == 1, "first replica ready")
            await fleet.scale(2)
            await _until(fleet, lambda: fleet.ready_count() == 2, "second replica ready")
            recs = {r.node: r for r in start_records(fleet.events.path)}
            assert recs["a"].image_source == "cache", recs["a"]
            assert recs["a"].image_ready is not None
            assert recs["b"].image_source == "pull", recs["b"]
            assert recs["b"].image_ready is not None and recs["b"].ok
            for name in ("a", "b"):
                info = ImageCache(fleet.nodes[name].cache.store).find(image)
                assert info.digest == layout.images["linux/amd64"].manifest
                assert info.references == ("chat",)
            assert reg.requests("/manifests/"), "the registry saw no manifest request"
            # The report: an image stage per class, image cache hits 1 of 2 starts.
            assert any(row.stage == "image_ready" for row in stage_table(recs.values()))
            headers, rows = class_table(summarize_classes(recs.values()))
            cells = [row[headers.index("image cache hits")] for row in rows]
            counts = [c.rsplit("(", 1)[1].rstrip(")").split("/") for c in cells]
            assert sum(int(h) for h, _ in counts) == 1 and sum(int(t) for _, t in counts) == 2
        for name in ("a", "b"):
            cache = ImageCache(NodeStore(tmp_path / "nodes" / name, capacity=1 << 30))
            assert cache.find(image).references == ()


async def test_registry_down_does_not_block_readiness(tmp_path: Path, free_port: int) -> None:
    """With nothing listening at the image's registry the replica still becomes Ready; its
    record says ``pull`` with no ``image_ready`` and the fleet says why."""
    model = make_model(tmp_path / "origin" / "m1", size=2 * MB, shards=2, seed=4)
    image = f"127.0.0.1:{free_port}/team/app:v1"
    spec = _spec(model.ref, image, replicas=1, weights={"enabled": True})
    cluster = cluster_spec(tmp_path, ["a"], slots=1)
    async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
        await _until(fleet, lambda: fleet.ready_count() == 1, "replica ready without its image")
        (rec,) = start_records(fleet.events.path)
        assert rec.ok and rec.first_response is not None
        assert rec.image_source == "pull" and rec.image_ready is None
        assert not fleet.warmer.images.holds("a", image)
        said = "\n".join(fleet.messages)
        assert f"starts without image {image}" in said, said
        assert f"image pull of {image} on a failed" in said, said


@pytest.mark.parametrize(
    ("image", "says", "fix"),
    [
        (None, "no variant has an image", "REGISTRY/REPO:TAG"),
        ("Team/App:v1!", "image 'Team/App:v1!'", "tag 'v1!' is invalid"),
    ],
)
def test_image_cache_needs_a_valid_image(image: str | None, says: str, fix: str) -> None:
    """``modelCacheConfig.image.enabled`` without an image, or with a bad reference, is a
    ConfigError that names it and the fix."""
    extra = {"image": image} if image else {}
    with pytest.raises(ConfigError, match=says) as err:
        endpoint_spec(
            "chat", "file:///srv/m", modelCacheConfig={"image": {"enabled": True}}, **extra
        )
    assert fix in str(err.value)


async def test_apply_another_image_drops_the_old_reference(tmp_path: Path) -> None:
    """After ``apply`` with a new image and the rollout, the node holds the new image and
    the old one (no longer used by a variant or replica) is unreferenced and removed."""
    model = make_model(tmp_path / "origin" / "m1", size=MB, shards=1, seed=5)
    old = write_layout(tmp_path / "old", [128 * KiB], seed=1)
    new = write_layout(tmp_path / "new", [128 * KiB], seed=2)
    with registry(tmp_path / "reg") as reg:
        reg.push(old.path, "team/app:v1")
        reg.push(new.path, "team/app:v2")
        v1, v2 = reg.ref("team/app:v1"), reg.ref("team/app:v2")
        cluster = cluster_spec(tmp_path, ["a"], slots=2)
        weights = {"enabled": True}
        async with LocalFleet(
            _spec(model.ref, v1, replicas=1, weights=weights), cluster, tmp_path / "state"
        ) as fleet:
            images = fleet.warmer.images
            await _until(fleet, lambda: fleet.ready_count() == 1 and images.holds("a", v1), "v1")
            await fleet.apply(_spec(model.ref, v2, replicas=1, weights=weights))
            await _until(
                fleet,
                lambda: images.holds("a", v2) and ("a", v1) not in images.entries,
                "v2 held and v1 dropped",
            )
            cache = ImageCache(fleet.nodes["a"].cache.store)

            def v1_gone() -> bool:
                # The entry goes first; the unreference finishes in its thread after it.
                try:
                    cache.find(v1)
                except SnapshotNotFound:
                    return True
                return False

            await _until(fleet, v1_gone, "v1 unreferenced and removed")
            assert cache.find(v2).references == ("chat",)
