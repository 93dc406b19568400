"""The node agent's warm-ups without peer flags (``agent_warmups.Warmups``): their fills
spare the unused warmed copies (``runtime.warm_room``, recorded in the store across a
restart), against a real store and file:// models under ``tmp_path``."""

from __future__ import annotations

import asyncio
from pathlib import Path

from preheat.bench.models import generate_model
from preheat.runtime.kubernetes.agent_config import AgentConfig
from preheat.runtime.kubernetes.agent_metrics import AgentMetrics
from preheat.runtime.kubernetes.agent_warmups import Warmups
from preheat.store import NodeStore


async def _until(what: str, check: object, timeout: float = 10.0) -> None:
    assert callable(check)
    for _ in range(int(timeout / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not true within {timeout} s")


async def test_a_plain_agent_warm_up_never_evicts_an_unused_warmed_copy(tmp_path: Path) -> None:
    """With room for one model, the second warm-up fails with ``WarmupDeferred`` (retried)
    and the first warm-up's copy stays; once a pod's lease has used that copy and ended,
    the second warm-up may evict it."""
    for i, name in enumerate(("m1", "m2")):
        generate_model(tmp_path / name, 1_000_000, shards=1, seed=i)
    store = NodeStore(tmp_path / "store", capacity=1_500_000, fsync=False)
    cfg = AgentConfig(node="n0", store=tmp_path / "store", backoff_s=0.05, backoff_max_s=0.1)
    warmups = Warmups(cfg, store, AgentMetrics(), asyncio.Event())
    m1, m2 = (f"file://{tmp_path / n}" for n in ("m1", "m2"))
    try:
        warmups.ensure({"m1": (m1, None)})
        await _until("m1 warmed", lambda: "m1" not in warmups.warms)
        (first,) = store.snapshots()
        warmups.ensure({"m1": (m1, None), "m2": (m2, None)})
        failure = lambda: warmups.last_failure and warmups.last_failure.reason  # noqa: E731
        await _until("m2 deferred", lambda: "WarmupDeferred" in str(failure()))
        await asyncio.sleep(0.3)  # a few retries later
        assert [s.digest for s in store.snapshots()] == [first.digest], failure()
        assert "no replica has used yet" in str(failure())
        store.lease(first.digest, "pod:ns/p:uid")  # a pod uses the copy, then ends
        store.release(first.digest, "pod:ns/p:uid")
        warmups.ensure({"m2": (m2, None)})
        await _until("m2 warmed", lambda: "m2" not in warmups.warms)
        assert first.digest not in {s.digest for s in store.snapshots()}
    finally:
        warmups.cancel_all()


async def test_the_agent_spares_a_copy_warmed_before_its_restart_and_a_racing_fill(
    tmp_path: Path,
) -> None:
    """A copy warmed before the agent restarted (new store object, new warm-ups) is still
    spared by the new agent's warm-up, also when another fill takes the free room between
    the warm-up's look at the store (``room``) and its reservation: the used copy goes."""
    for i, name in enumerate(("w", "o", "a", "b")):
        generate_model(tmp_path / name, 1_000_000, shards=1, seed=i + 7)
    w, o, a, b = (f"file://{tmp_path / n}" for n in ("w", "o", "a", "b"))
    root = tmp_path / "store"
    cfg = AgentConfig(node="n0", store=root, backoff_s=0.05, backoff_max_s=0.1)
    before = Warmups(cfg, NodeStore(root, capacity=3_500_000, fsync=False), AgentMetrics(),
                     asyncio.Event())  # fmt: skip
    before.ensure({"w": (w, None)})
    await _until("w warmed", lambda: "w" not in before.warms)
    (wd,) = {s.digest for s in before.store.snapshots()}
    # the agent restarts: a new store object and new warm-ups over the same directory
    store = NodeStore(root, capacity=3_500_000, fsync=False)
    od = (await store.apull(o)).manifest_digest
    store.lease(od, "pod:ns/o:uid")
    store.release(od, "pod:ns/o:uid")

    class Racing(Warmups):
        async def room(self, source: str, revision: str | None) -> frozenset[str]:
            spare = await super().room(source, revision)
            await store.apull(b)  # another fill takes the room now
            return spare

    after = Racing(cfg, store, AgentMetrics(), asyncio.Event())
    try:
        after.ensure({"a": (a, None)})
        await _until("a warmed", lambda: "a" not in after.warms)
        held = {s.digest for s in store.snapshots()}
        assert wd in held and od not in held, after.last_failure
    finally:
        after.cancel_all()
