"""The fleet's cluster-wide revocation list on real node stores, engines and the router."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.control.spec import parse_endpoint
from preheat.errors import Revoked
from preheat.runtime.control_api import ControlServer
from preheat.runtime.local import LocalFleet
from preheat.store.store import NodeStore
from preheat.testing.fleet import cluster_spec, make_model, run_load

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


def _spec(source: str, *fallback: str) -> object:
    return parse_endpoint(
        {
            "name": "chat",
            "model": {"source": source, "fallback": [{"source": f} for f in fallback]},
            "engine": {"simulated": {"profile": "tiny", "time_scale": 0.01}},
            "replicas": {"min": 2, "max": 4},
            "modelCacheConfig": {"weights": {"enabled": True}},
        }
    )


async def test_revoked_revision_rolls_to_fallback_under_load(tmp_path: Path) -> None:
    """Revoking the running revision reaches both node stores, rolls the replicas to the
    spec's fallback with no failed request, removes the revoked snapshot everywhere once
    unused, refuses a new pull of it, and survives in the state dir; unrevoke lifts it."""
    m1 = make_model(tmp_path / "origin" / "m1", size=2 * MB, shards=2, seed=1)
    m0 = make_model(tmp_path / "origin" / "m0", size=2 * MB, shards=2, seed=7)
    cluster = cluster_spec(tmp_path, ["a", "b"], bandwidth="20MB/s")
    state = tmp_path / "state"
    async with LocalFleet(_spec(m1.ref, m0.ref), cluster, state) as fleet:  # type: ignore[arg-type]
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        r1 = fleet.status()["variants"][0]["revision"]
        stop = asyncio.Event()
        load = asyncio.create_task(
            run_load(fleet.router.url, requests=1500, concurrency=4, timeout=60, stop=stop)
        )
        await asyncio.sleep(0.3)
        out = await fleet.revoke(r1, "CVE-2026-0001 in the tokenizer config")
        assert out["key"] == r1 and out["nodes"] == 2
        await fleet.wait_until(
            lambda f: (
                f.ready_count() == 2
                and all(r["revision"] != r1 for r in f.status()["replicas"])
                and not any(n["cache"].get(r1) for n in f.status()["nodes"])
            ),
            60,
            "roll to the fallback and removal of the revoked revision",
        )
        stop.set()
        result = await load
        assert result.ok > 20 and result.failed == 0, result.errors[:5]
        st = fleet.status()
        v = st["variants"][0]
        assert "rolling to fallback" in (v["revoked"] or ""), v
        r0 = {r["revision"] for r in st["replicas"]}
        assert len(r0) == 1 and r1 not in r0
        assert [e["key"] for e in st["revocations"]] == [r1]
        assert any("CVE-2026-0001" in m for m in st["messages"])
        for node in ("a", "b"):
            store = NodeStore(tmp_path / "nodes" / node)
            assert not store.has(r1) and r1 in store.revoked()
            with pytest.raises(Revoked, match="revoked"):
                await store.apull(m1.ref)
        saved = json.loads((state / "revocations.json").read_text())
        assert saved[r1]["reason"].startswith("CVE-2026-0001")
        assert await fleet.unrevoke(r1)
        assert fleet.status()["revocations"] == []
        await fleet.wait_until(
            lambda f: f.ready_count(revision=r1) == 2, 60, "back on the unrevoked revision"
        )
        assert fleet.status()["variants"][0]["revoked"] is None
        assert r1 not in NodeStore(tmp_path / "nodes" / "a").revoked()


async def test_revoked_without_fallback_keeps_serving_and_says_so(tmp_path: Path) -> None:
    """`preheat revoke` through the control API: with no fallback the replicas keep serving,
    the variant says it is revoked with no allowed fallback, and a node added later gets
    the list too; a restarted fleet loads the list from the state dir."""
    m1 = make_model(tmp_path / "origin" / "m1", size=1 * MB, shards=1, seed=1)
    cluster = cluster_spec(tmp_path, ["a", "b"], bandwidth="20MB/s")
    state = tmp_path / "state"
    async with LocalFleet(_spec(m1.ref), cluster, state) as fleet:  # type: ignore[arg-type]
        await fleet.wait_until(lambda f: f.ready_count() == 2, 60, "two replicas")
        r1 = fleet.status()["variants"][0]["revision"]
        server = ControlServer(fleet)
        await server.start()
        try:
            runner = CliRunner()
            res = await asyncio.to_thread(
                runner.invoke,
                main,
                ["revoke", r1, "--reason", "withdrawn", "--state-dir", str(state)],
            )
            assert res.exit_code == 0, res.output
            assert f"revoked {r1}" in res.output
            bad = await asyncio.to_thread(
                runner.invoke, main, ["revoke", " ", "--state-dir", str(state)]
            )
            assert bad.exit_code == 2 and "key" in bad.output
        finally:
            await server.stop()
        await fleet.wait_until(
            lambda f: bool(f.status()["variants"][0]["revoked"]), 30, "revoked in status"
        )
        await asyncio.sleep(0.5)  # a few passes: nothing may stop the serving replicas
        v = fleet.status()["variants"][0]
        assert "no other revision" in v["revoked"] and fleet.ready_count(revision=r1) == 2
        await fleet.add_node("c")
        assert r1 in NodeStore(tmp_path / "state" / "nodes" / "c").revoked()
    async with LocalFleet(_spec(m1.ref), cluster, state) as again:  # type: ignore[arg-type]
        assert [e["key"] for e in again.status()["revocations"]] == [r1]
        assert r1 in NodeStore(tmp_path / "nodes" / "a").revoked()
