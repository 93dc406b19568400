"""PodStartRecorder's bookkeeping (one record per start, restarts, deletions) and the JSONL
append that `preheat k8s records --out` uses; pod events fed in directly, no API calls."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kubernetes import client
from prometheus_client import generate_latest

from preheat.runtime.kubernetes.podrecords import PodStartRecorder, append_new_records
from preheat.telemetry.events import read_start_records
from preheat.telemetry.records import EventClass
from tests.unit.test_k8s_podrecords import READY_POD, pending_pod, restarted_pod


def recorder() -> PodStartRecorder:
    """A recorder whose API client points nowhere: these tests never list or watch."""
    cfg = client.Configuration()
    cfg.host = "https://127.0.0.1:1"
    return PodStartRecorder(client.ApiClient(cfg), "default", clock=lambda: 1796129999.0)


def test_one_record_per_start_however_many_events() -> None:
    """Pending events make nothing, the Ready event one record, repeats of it none; a
    restart makes one warm_restart record; metrics count each once."""
    rec = recorder()
    assert rec.observe(pending_pod()) == []
    first = rec.observe(READY_POD)
    assert [r.restart_count for r in first] == [0]
    assert rec.observe(copy.deepcopy(READY_POD)) == []
    again = rec.observe(restarted_pod())
    assert [(r.restart_count, r.event_class) for r in again] == [(1, EventClass.WARM_RESTART)]
    assert rec.observe(restarted_pod()) == []
    assert len(rec.snapshot()) == 2
    text = generate_latest(rec.registry).decode()
    assert 'preheat_starts_total{event_class="warm_restart",outcome="ok"} 1.0' in text


def test_restart_before_ready_records_the_failed_start() -> None:
    """A pod never Ready whose engine restarted: its first start is a failure, the restart
    (Ready) a good warm_restart."""
    rec = recorder()
    rec.observe(pending_pod())
    out = rec.observe(restarted_pod())
    assert [(r.restart_count, r.ok) for r in out] == [(0, False), (1, True)]
    assert out[0].failure is not None and "before the pod was Ready" in out[0].failure


def test_deleted_before_ready_is_a_failure_and_after_ready_is_not() -> None:
    """Deleting a starting pod records a failed start; deleting a served one adds nothing."""
    rec = recorder()
    rec.observe(pending_pod())
    out = rec.observe(pending_pod(), deleted=True)
    assert len(out) == 1 and out[0].failure == "pod deleted before it became Ready"
    served = recorder()
    served.observe(READY_POD)
    assert served.observe(READY_POD, deleted=True) == []


def test_scale_out_beside_a_ready_pod_and_new_node_are_classified() -> None:
    """A second pod created after the first was Ready is scale_out."""
    rec = recorder()
    rec.observe(READY_POD)
    second: dict[str, Any] = copy.deepcopy(READY_POD)
    second["metadata"].update(
        name="chat-main-def", uid="u-2", creationTimestamp="2026-12-01T13:05:00Z"
    )
    for c in second["status"]["conditions"]:
        if c["type"] in ("Ready", "ContainersReady"):
            c["lastTransitionTime"] = "2026-12-01T13:05:04Z"
    (r,) = rec.observe(second)
    assert r.event_class is EventClass.SCALE_OUT and r.weights_source == "origin"


def test_append_new_records_skips_starts_the_file_holds(tmp_path: Path) -> None:
    """Appending the same starts twice writes them once; a new one is added."""
    rec = recorder()
    rec.observe(READY_POD)
    path = tmp_path / "starts.jsonl"
    assert append_new_records(path, rec.snapshot()) == 1
    assert append_new_records(path, rec.snapshot()) == 0
    rec.observe(restarted_pod())
    assert append_new_records(path, rec.snapshot()) == 1
    assert [r.restart_count for r in read_start_records(path)] == [0, 1]


def test_records_cli_refuses_contradicting_options() -> None:
    """--json with --out, and --metrics-port without --watch, are usage errors (exit 2)
    named before any connection is tried."""
    from click.testing import CliRunner

    from preheat.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["k8s", "records", "--json", "--out", "x.jsonl"])
    assert res.exit_code == 2 and "give one" in res.output
    res = runner.invoke(main, ["k8s", "records", "--metrics-port", "9102"])
    assert res.exit_code == 2 and "--watch" in res.output
