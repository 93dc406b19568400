"""A rollout on nodes whose disks hold one copy of the model: the old copy yields its room
to the new revision on the nodes no replica uses it on (``control.plan`` step 6), so the
rollout goes on at once instead of stalling (pinned: never evicted) or waiting for the
gate's timeout (unpinned: a warm-up spares another warm-up's copy no replica used)."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.runtime.local import LocalFleet
from preheat.store.store import NodeStore
from preheat.testing.fleet import cluster_spec, endpoint_spec, make_model
from preheat.testing.origins import nginx_origin

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


def _alone(base: Path, node: str, revision: str, pinned: bool) -> bool:
    """Whether ``node``'s store holds ``revision`` as its only snapshot, pinned or not."""
    store = NodeStore(base / "nodes" / node)
    if not store.has(revision):
        return False
    snaps = store.snapshots()
    return len(snaps) == 1 and snaps[0].pinned is pinned


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "unpinned"])
async def test_the_old_copy_yields_to_the_new_revision_on_a_tight_disk(
    tmp_path: Path, web_root: Path, pin: bool
) -> None:
    """Three nodes of 6 MB (5.4 MB under the 0.9 watermark), a 4 MB model warmed on each
    (pinned, or not), one replica. A new revision shares no byte with the old one: beside
    the old copy it is short of room on every node (``unfit`` beside a pin; ``failed``
    beside an unused warmed copy, which warm-ups spare). The planner deletes the old copy on the two idle nodes,
    the new revision warms there, the replica rolls, the last old copy goes and that node warms the new one. On the
    old planner ``stable`` did not move within 60 s: never with a pin, and not before
    the gate's 600 s timeout without."""
    m1 = make_model(web_root / "m1", size=4 * MB, shards=2, seed=1)
    m2 = make_model(web_root / "m2", size=4 * MB, shards=2, seed=2)
    cache = {"enabled": True, "pin": pin}
    with nginx_origin(web_root) as origin:
        spec = endpoint_spec("chat", m1.http_ref(origin.base_url, web_root), cache=cache)
        cluster = cluster_spec(tmp_path, ["a", "b", "c"], capacity="6MB", slots=1)
        async with LocalFleet(spec, cluster, tmp_path / "state") as fleet:
            await fleet.wait_until(lambda f: f.ready_count() == 1, 60, "one replica")
            r1 = fleet.status()["variants"][0]["revision"]
            # deployed: r1 is the stable revision a rollback would go back to (the planner
            # keeps it on every node until the next rollout finishes)
            await fleet.wait_until(
                lambda f: f.status()["variants"][0]["stable"] == r1, 30, "r1 deployed"
            )
            for n in "abc":
                await fleet.wait_until(lambda f, n=n: _alone(tmp_path, n, r1, pin), 30, f"{n} warm")
            new = endpoint_spec("chat", m2.http_ref(origin.base_url, web_root), cache=cache)
            await fleet.apply(new)
            r2 = fleet.status()["variants"][0]["revision"]
            assert r2 != r1
            await fleet.wait_until(
                lambda f: (
                    f.status()["variants"][0]["stable"] == r2 and f.ready_count(revision=r2) == 1
                ),
                60,
                "the rollout to the new revision",
            )
            await fleet.wait_until(
                lambda f: all(not NodeStore(tmp_path / "nodes" / n).has(r1) for n in "abc"),
                30,
                "the old copies to go",
            )
            # the node that served the old revision warms the new one once its copy went
            # (the warm-up's backoff retry); with a pin the new copies are pinned in turn
            await fleet.wait_until(
                lambda f: all(_alone(tmp_path, n, r2, pin) for n in "abc"),
                30,
                "every node to hold the new revision alone",
            )
            messages = fleet.status()["messages"]
            assert any(f"deleted {r1[:12]}" in m for m in messages), messages[-10:]
