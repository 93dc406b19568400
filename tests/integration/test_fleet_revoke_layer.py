"""A revoked tar layer on the fleet's list: a ``model.fallback`` built from the same
layer is never chosen, even though no node ever pulled it (real registry, stores,
engines, router)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from preheat.control.spec import parse_endpoint
from preheat.runtime.local import LocalFleet
from preheat.store.store import NodeStore
from preheat.testing.fleet import cluster_spec
from preheat.testing.registry import ModelLayer, registry, tar_layer

pytestmark = pytest.mark.timeout(120)

WEIGHT = "application/vnd.cncf.model.weight.v1.tar+gzip"
CONFIG = "application/vnd.cncf.model.weight.config.v1.tar"


async def test_a_fallback_built_from_a_revoked_layer_is_not_chosen(tmp_path: Path) -> None:
    """v1 and its fallback v0 share a gzip weight layer; revoking that layer marks the
    variant revoked with no allowed fallback (v1 keeps serving, the layer lists come from
    the registry), and v0 is never pulled; v2, a fallback without the layer, is."""
    bad = tar_layer([("w.safetensors", b"w" * 40_000)], "gzip")
    good = tar_layer([("w.safetensors", b"g" * 40_000)], "gzip")
    digest = "sha256:" + hashlib.sha256(bad).hexdigest()
    with registry(tmp_path / "reg") as reg:
        for tag, weights, n in (("v1", bad, 1), ("v0", bad, 0), ("v2", good, 2)):
            cfg = tar_layer([("config.json", b'{"n": %d}' % n)])
            reg.push_model_layers(
                f"models/m:{tag}", [ModelLayer(WEIGHT, weights), ModelLayer(CONFIG, cfg)]
            )
        v1, v0, v2 = (f"oci://{reg.ref(f'models/m:{t}')}" for t in ("v1", "v0", "v2"))

        def spec(*fallback: str) -> object:
            return parse_endpoint(
                {
                    "name": "chat",
                    "model": {"source": v1, "fallback": [{"source": f} for f in fallback]},
                    "engine": {"simulated": {"profile": "tiny", "time_scale": 0.01}},
                    "replicas": {"min": 1, "max": 2},
                    "modelCacheConfig": {"weights": {"enabled": True}},
                }
            )

        cluster = cluster_spec(tmp_path, ["a"])
        async with LocalFleet(spec(v0), cluster, tmp_path / "state") as fleet:  # type: ignore[arg-type]
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
            r1 = fleet.status()["variants"][0]["revision"]
            fetched = len(reg.requests(f"/blobs/{digest}"))
            await fleet.revoke(digest, "CVE-2026-0002 in the weights")
            await fleet.wait_until(
                lambda f: "no other revision" in (f.status()["variants"][0]["revoked"] or ""),
                30,
                "revoked with no allowed fallback",
            )
            await asyncio.sleep(0.5)  # a few passes: v0 must not be warmed meanwhile
            st = fleet.status()
            assert fleet.ready_count(revision=r1) == 1
            assert {r["revision"] for r in st["replicas"]} == {r1}
            assert any("v0" in m and digest[:19] in m for m in st["messages"]), st["messages"]
            store = NodeStore(tmp_path / "nodes" / "a")
            assert {r for s in store.snapshots() for r in s.revisions} == {r1}
            assert len(reg.requests(f"/blobs/{digest}")) == fetched, "the layer was fetched"
        async with LocalFleet(spec(v0, v2), cluster, tmp_path / "state") as fleet:  # type: ignore[arg-type]
            await fleet.wait_until(
                lambda f: (
                    f.ready_count() == 1
                    and all(r["revision"] != r1 for r in f.status()["replicas"])
                ),
                60,
                "the roll to v2",
            )
            assert "rolling to fallback" in (fleet.status()["variants"][0]["revoked"] or "")
            revs = {r for s in NodeStore(tmp_path / "nodes" / "a").snapshots() for r in s.revisions}
            assert len(revs) == 1 and r1 not in revs
