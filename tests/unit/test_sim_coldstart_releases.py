"""Cold-start simulator: version changes (``releases``), rolled by the live planner."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.errors import ConfigError
from preheat.sim.coldstart import simulate
from preheat.sim.coldstart_catalog import catalog_from_dict
from preheat.sim.coldstart_files import prepare
from preheat.sim.coldstart_releases import with_releases
from preheat.sim.coldstart_result import ColdStartResult
from preheat.telemetry.records import EventClass

GB = 10**9
RELEASE_AT = 3600.0


def _catalog(*, releases: list[dict[str, Any]] | None = None, pin: bool = False) -> dict[str, Any]:
    m: dict[str, Any] = {"name": "m", "size": "100GB", "popularity": 1, "max_replicas": 4}
    if pin:
        m.update(pin=True, priority=5)
    if releases is not None:
        m["releases"] = releases
    return {
        "models": [m],
        "autoscaling": {"target_in_flight": 16, "scale_in_below": 4, "cooldown_seconds": 60},
        "traffic": {"replica_mtbf_seconds": 0},
    }


def _run(
    tmp_path: Path, policy: str, *, release: bool = True, pin: bool = False, **kw: Any
) -> ColdStartResult:
    """Two replicas of a 100 GB model all along (32 in flight), on 4 nodes with 1 TB, an
    origin of 2 GB/s; with ``release``, a new revision at 1 h."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"t": 0, "model": "m", "in_flight": 32}) + "\n")
    args: dict[str, Any] = {
        "nodes": 4,
        "nvme": "1TB",
        "policy": policy,
        "trace": trace,
        "origin_bandwidth": "2GB/s",
        "duration": "3h",
        "seed": 1,
    }
    args.update(kw)
    cat = catalog_from_dict(_catalog(releases=[{"at": "1h"}] if release else None, pin=pin))
    setup, rng = prepare(models=cat, **args)
    return simulate(setup, rng)


def _new_version(res: ColdStartResult) -> list[Any]:
    return [r for r in res.world.records if r.event_class is EventClass.NEW_VERSION]


def test_a_release_rolls_every_replica_as_new_version_starts(tmp_path: Path) -> None:
    """At the release the planner rolls the model: both replicas are replaced by starts of
    the new revision, classified new_version, the old ones drained; the rollout finishes,
    readiness reports the new_version row, and the seeded run repeats exactly."""
    res = _run(tmp_path, "lru")
    out = res.summary
    nv = _new_version(res)
    assert [r.revision for r in nv] == ["rev-m@1", "rev-m@1"]
    assert all(r.scheduled >= RELEASE_AT for r in nv)
    assert out["releases"] == 1 and out["rollouts_finished"] == 1
    assert out["readiness"]["new_version"]["n"] == 2
    assert out["classes"]["new_version"]["miss_share"] == 1.0  # lru: nothing warms it
    live = [(r.revision, r.phase) for r in res.world.replicas.values()]
    assert live == [("rev-m@1", "ready"), ("rev-m@1", "ready")]
    assert _run(tmp_path, "lru").summary == out
    # The rollout's duration runs from the release past the last new replica's readiness
    # (then the last old one drains), and no rollout is left unfinished.
    last_ready = max(r.scheduled + r.ready_seconds for r in nv) - RELEASE_AT
    took = out["rollout_s"]
    assert took["n"] == 1 and last_ready <= took["max_s"] < 2 * last_ready, took
    assert out["rollouts_unfinished"] == 0
    # No release, no new_version starts and no rollout.
    plain = _run(tmp_path, "lru", release=False).summary
    assert "new_version" not in plain["classes"] and plain["rollouts_finished"] == 0
    assert plain["rollout_s"]["n"] == 0 and plain["rollouts_unfinished"] == 0


def test_a_release_overtaken_by_the_next_counts_as_an_unfinished_rollout(
    tmp_path: Path,
) -> None:
    """A second release 60 s after the first (the first rollout takes minutes) supersedes
    it: only the second rollout finishes and is timed, the first is reported unfinished."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"t": 0, "model": "m", "in_flight": 32}) + "\n")
    cat = catalog_from_dict(_catalog(releases=[{"at": "1h"}, {"at": "3660s"}]))
    setup, rng = prepare(
        models=cat, nodes=4, nvme="1TB", policy="lru", trace=trace,
        origin_bandwidth="2GB/s", duration="3h", seed=1,
    )  # fmt: skip
    out = simulate(setup, rng).summary
    assert out["releases"] == 2 and out["rollouts_finished"] == 1
    assert out["rollout_s"]["n"] == 1 and out["rollouts_unfinished"] == 1


def test_warm_all_warms_the_new_revision_before_the_rollout_and_misses_less(
    tmp_path: Path,
) -> None:
    """warm-all warms the new revision on all 4 nodes (one origin fill at a time, 50 s
    each) and its cache gate holds the rollout until they hold it: every new_version start
    is a hit, against a miss on each without a cache. With peers the new revision costs
    the origin one copy; the other three come from peers."""
    none = _run(tmp_path, "none").summary["classes"]["new_version"]
    res = _run(tmp_path, "warm-all")
    out = res.summary
    nv = _new_version(res)
    assert len(nv) == 2 and {r.weights_source for r in nv} == {"cache"}
    assert min(r.scheduled for r in nv) >= RELEASE_AT + 4 * 50
    # The gate makes the rollout longer than without a cache (it waits for the warm-ups),
    # while every one of its starts is a hit.
    assert out["rollout_s"]["max_s"] > _run(tmp_path, "none").summary["rollout_s"]["max_s"]
    assert out["warmups"] == 2 * 4  # each revision on every node
    assert out["classes"]["new_version"]["miss_share"] < none["miss_share"] == 1.0
    peers = _run(tmp_path, "warm-all", peers=True).summary
    before = _run(tmp_path, "warm-all", peers=True, release=False).summary
    assert peers["origin_bytes"] - before["origin_bytes"] == 100 * GB
    assert peers["peer_bytes"] - before["peer_bytes"] == 3 * 100 * GB


def test_superseded_copies_go_once_unused_and_are_evicted_under_pressure(
    tmp_path: Path,
) -> None:
    """Old-revision copies are not kept: with room the planner deletes each once the
    rollout finished and no replica uses it (warm-all: on all 4 nodes); on 2 nodes whose
    disks hold one copy, each new revision's fill evicts the node's old copy by
    plan_eviction. No superseded byte is left on a disk at the end either way."""
    roomy = _run(tmp_path, "warm-all")
    assert roomy.summary["revisions_deleted"] == 4
    assert {rev for _, _, rev in roomy.world.deleted} == {"rev-m"}
    assert all(r.time >= RELEASE_AT for r in roomy.world.evictions)
    tight = _run(tmp_path, "lru", nodes=2, nvme="150GB")
    evicted = [(e.revision, e.for_revision) for e in tight.world.evictions]
    assert evicted == [("rev-m", "rev-m@1")] * 2
    assert tight.summary["rollouts_finished"] == 1
    for res in (roomy, tight):
        assert res.summary["superseded_bytes_at_end"] == 0
        assert all("rev-m" not in n.snaps for n in res.world.nodes.values())


def test_a_pinned_old_revision_yields_its_room_to_the_new_one_on_a_tight_disk(
    tmp_path: Path,
) -> None:
    """``priority`` pins the model on every node; each 150 GB disk holds one 100 GB copy.
    At the release the planner deletes the pinned old copy from the nodes no replica uses
    (the live rule, ``control.plan`` step 6), the new revision warms there and the rollout
    finishes; then the last old copies go. Before, the new revision was ``unfit`` beside
    the pin everywhere and the rollout never finished."""
    res = _run(tmp_path, "priority", pin=True, nvme="150GB")
    out = res.summary
    assert out["rollouts_finished"] == 1 and out["rollouts_unfinished"] == 0, out
    assert out["rollout_s"]["max_s"] < 900, out["rollout_s"]
    live = [(r.revision, r.phase) for r in res.world.replicas.values()]
    assert live == [("rev-m@1", "ready"), ("rev-m@1", "ready")]
    gone = sorted(node for _, node, rev in res.world.deleted if rev == "rev-m")
    assert gone == ["node-000", "node-001", "node-002", "node-003"]
    # the first deletions come at the release: room for the new revision on idle nodes
    assert min(t for t, _, _ in res.world.deleted) == RELEASE_AT
    # the gate waited for the freed nodes (not 0 of 0): both new replicas start warm
    assert out["classes"]["new_version"]["misses"] == 0, out["classes"]["new_version"]
    # the new copies are pinned in turn
    assert all(n.snaps["rev-m@1"].pinned for n in res.world.nodes.values() if n.holds("rev-m@1"))


@pytest.mark.parametrize(
    ("releases", "message"),
    [
        ("6h", r"releases = '6h'; give a list like \[\{at: 8h\}\]"),
        ([{"size": "1GB"}], r"releases\[0\] = \{'size': '1GB'\}; give a mapping like"),
        ([{"at": "soon"}], r"releases\[0\]\.at 'soon' is not a duration"),
        ([{"at": "6h"}, {"at": "2h"}], r"releases\[1\]\.at = '2h' is not after .*21600 s"),
        ([{"at": "6h", "size": "big"}], r"releases\[0\]\.size 'big' is not a size"),
        (
            [{"at": "6h", "sise": "1GB"}],
            r"releases\[0\]: unknown key\(s\) \['sise'\]; known: at, size",
        ),
    ],
)
def test_bad_releases_name_the_value(releases: Any, message: str) -> None:
    """Each bad ``releases:`` entry is a ConfigError naming the model, the value and the fix."""
    with pytest.raises(ConfigError, match=r"model 'm' " + message):
        catalog_from_dict(_catalog(releases=releases))


def test_release_option_and_its_errors(tmp_path: Path) -> None:
    """``--release m@1h`` adds the release on the command line (the JSON counts it);
    an unknown model, a missing time or a release after the run's end name the value."""
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - {name: m, size: 100GB, popularity: 1, max_replicas: 4}\n")
    args = ["sim", "coldstart", "--nodes", "4", "--nvme", "1TB", "--models", str(models)]
    args += ["--pattern", "burst", "--cache-policy", "warm-all", "--duration", "3h"]
    result = CliRunner().invoke(main, [*args, "--release", "m@1h=120GB", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["releases"] == 1 and out["classes"]["new_version"]["starts"] > 0
    text = CliRunner().invoke(main, [*args, "--release", "m@1h"])
    assert "releases 1: rollouts finished 1" in text.output
    cat = catalog_from_dict(_catalog(releases=[{"at": "2h"}]))
    merged = with_releases(cat, ["m@1h=120GB"]).models[0].releases
    assert [(r.at, r.size) for r in merged] == [(3600.0, 120 * GB), (7200.0, 100 * GB)]
    for bad, message in [
        ("x@1h", r"--release 'x@1h' names no model of the models file \(m\)"),
        ("m1h", r"--release 'm1h'; write MODEL@TIME or MODEL@TIME=SIZE"),
        ("m@4h", r"model 'm' has a release at 14400 s, not before the run ends at 10800 s"),
    ]:
        res = CliRunner().invoke(main, [*args, "--release", bad])
        assert res.exit_code == 2 and re.search(message, " ".join(res.output.split()))
        with pytest.raises(ConfigError, match=message):
            prepare(
                nodes=4, nvme="1TB", models=models, policy="lru", pattern="burst",
                duration="3h", releases=[bad],
            )  # fmt: skip
