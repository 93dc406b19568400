"""StartRecord validation, JSON round trips and the crash-safe JSONL log."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preheat.errors import ConfigError
from preheat.telemetry.events import (
    STAGES,
    EventClass,
    EventLog,
    SampledLog,
    StartRecord,
    read_start_records,
)


def make(**kw: object) -> StartRecord:
    base: dict[str, object] = {
        "endpoint": "chat",
        "variant": "main",
        "replica": "chat-main-0",
        "node": "node-a",
        "revision": "sha256:abc",
        "event_class": EventClass.COLD_POD_WARM_NODE,
        "scheduled": 1000.0,
        "image_ready": 1000.5,
        "weights_ready": 1001.0,
        "runtime_started": 1001.25,
        "weights_loaded": 1003.0,
        "healthy": 1003.5,
        "first_response": 1003.75,
        "image_source": "cache",
        "weights_source": "cache",
        "bytes_from": {"cache": 4096},
    }
    base.update(kw)
    return StartRecord(**base)  # type: ignore[arg-type]


def test_round_trip_keeps_every_field() -> None:
    """to_json then from_json gives an equal record, event class included."""
    rec = make(
        event_class=EventClass.NEW_NODE,
        weights_source="origin",
        bytes_from={"origin": 123, "cache": 0},
        restart_count=2,
        failure=None,
    )
    line = rec.to_json()
    assert "\n" not in line
    back = StartRecord.from_json(line)
    assert back == rec
    assert back.event_class is EventClass.NEW_NODE
    assert json.loads(line)["event_class"] == "new_node"


def test_stage_durations_are_consecutive_differences() -> None:
    """Each stage is its boundary minus the previous one; missing boundaries merge stages."""
    rec = make()
    d = rec.stage_durations()
    assert list(d) == list(STAGES)
    assert d == pytest.approx(
        {
            "image_ready": 0.5,
            "weights_ready": 0.5,
            "runtime_started": 0.25,
            "weights_loaded": 1.75,
            "healthy": 0.5,
            "first_response": 0.25,
        }
    )
    assert rec.ready_seconds == pytest.approx(3.5)
    partial = make(weights_loaded=None, first_response=None)
    assert partial.stage_durations()["healthy"] == pytest.approx(2.25)
    assert "weights_loaded" not in partial.stage_durations()


def test_failed_start_has_no_readiness() -> None:
    """A start that never became healthy keeps its reached boundaries and its reason."""
    rec = make(weights_loaded=None, healthy=None, first_response=None, failure="exit code 1")
    assert rec.ready_seconds is None
    assert not rec.ok
    assert StartRecord.from_json(rec.to_json()).failure == "exit code 1"


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"image_ready": 999.0}, "before scheduled"),
        ({"weights_source": "s3"}, "weights_source"),
        ({"image_source": "registry"}, "image_source"),
        ({"bytes_from": {"disk": 1}}, "bytes_from has source 'disk'"),
        ({"bytes_from": {"origin": -1}, "weights_source": "origin"}, "bytes >= 0"),
        ({"bytes_from": {"origin": 10}}, "remote bytes"),
        ({"event_class": "lukewarm"}, "use one of"),
        ({"node": ""}, "StartRecord.node"),
        ({"healthy": float("nan")}, "finite"),
        ({"restart_count": -1}, "restart_count"),
    ],
)
def test_invalid_records_are_rejected_with_the_value(kw: dict[str, object], fragment: str) -> None:
    """Bad fields raise ValueError naming the field and the bad value."""
    with pytest.raises(ValueError, match=fragment):
        make(**kw)


def test_from_json_rejects_unknown_keys_and_versions() -> None:
    """Unknown keys and future schema versions are errors, not silently dropped."""
    data = make().to_dict()
    with pytest.raises(ValueError, match="unknown keys"):
        StartRecord.from_dict({**data, "colour": "red"})
    with pytest.raises(ValueError, match="schema v=2"):
        StartRecord.from_dict({**data, "v": 2})


def test_event_log_appends_and_reads_back(tmp_path: Path) -> None:
    """Records appended to a log come back in order, one line each."""
    path = tmp_path / "sub" / "events.jsonl"
    recs = [make(replica=f"r{i}", scheduled=1000.0 - i, image_ready=None) for i in range(5)]
    with EventLog(path, fsync=True) as log:
        for r in recs:
            log.append(r)
    assert path.read_text().count("\n") == 5
    assert read_start_records(path) == recs


def test_torn_last_line_is_skipped_and_repaired(tmp_path: Path) -> None:
    """A crash mid-write leaves a fragment that readers skip and the next writer ends."""
    path = tmp_path / "events.jsonl"
    good = make()
    with EventLog(path) as log:
        log.append(good)
    torn = make(replica="torn").to_json()[:37]
    with open(path, "a") as f:
        f.write(torn)  # no newline: what a killed writer leaves
    assert read_start_records(path) == [good]
    later = make(replica="later")
    with EventLog(path) as log:
        log.append(later)
    assert read_start_records(path) == [good, later]


def _writer(path: str, worker: int, n: int) -> None:
    with EventLog(path) as log:
        for i in range(n):
            log.append(make(replica=f"w{worker}-{i}"))


def test_concurrent_processes_never_interleave_lines(tmp_path: Path) -> None:
    """Four processes appending at once produce only whole records."""
    path = tmp_path / "events.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 200)) for w in range(4)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    recs = read_start_records(path)
    assert sorted(r.replica for r in recs) == sorted(
        f"w{w}-{i}" for w in range(4) for i in range(200)
    )


def test_killed_writer_leaves_a_readable_log(tmp_path: Path) -> None:
    """SIGKILL of a process in the middle of appending never makes the log unreadable."""
    path = tmp_path / "events.jsonl"
    code = (
        "import sys\n"
        "from preheat.telemetry.events import EventLog, StartRecord\n"
        "log = EventLog(sys.argv[1])\n"
        "i = 0\n"
        "while True:\n"
        "    log.append(StartRecord('e','v',f'r{i}','n','rev','scale_out',1.0))\n"
        "    i += 1\n"
        "    if i == 50: print('go', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "go"
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    recs = read_start_records(path)
    assert len(recs) >= 50
    assert [r.replica for r in recs] == [f"r{i}" for i in range(len(recs))]


def test_invalid_record_line_names_file_and_line(tmp_path: Path) -> None:
    """A line that is JSON but not a record is an error with file:line, not a skip."""
    path = tmp_path / "events.jsonl"
    path.write_text(make().to_json() + "\n" + json.dumps({"endpoint": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"events.jsonl:2: .*incomplete"):
        read_start_records(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_start_records(tmp_path / "missing.jsonl")


def test_log_file_mode_is_append_only(tmp_path: Path) -> None:
    """Opening a log never truncates what is there."""
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.append(make())
    size = os.path.getsize(path)
    with EventLog(path) as log:
        log.append(make(replica="two"))
    assert os.path.getsize(path) > size
    assert len(read_start_records(path)) == 2


def test_sampled_log_writes_the_given_fraction(tmp_path: Path) -> None:
    """Rate 0.1 writes every tenth record, the first included; rate 1 writes all."""
    path = tmp_path / "decisions.jsonl"
    with EventLog(path) as log:
        sampled = SampledLog(log, 0.1)
        written = [sampled.offer(make(replica=f"r{i}")) for i in range(1000)]
    assert written[0] is True
    assert 99 <= sum(written) <= 101
    assert sampled.offered == 1000 and sampled.written == sum(written)
    assert len(read_start_records(path)) == sum(written)
    with EventLog(tmp_path / "all.jsonl") as log:
        everything = SampledLog(log, 1.0)
        assert all(everything.offer(make()) for _ in range(10))
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="outside"):
            SampledLog(EventLog(tmp_path / "x.jsonl"), bad)


def test_hooks_see_each_record_and_never_break_the_log(tmp_path: Path) -> None:
    """Hooks run after each write; a failing hook is counted, the record is still kept."""
    seen: list[StartRecord] = []

    def broken(record: StartRecord) -> None:
        raise RuntimeError("exporter down")

    with EventLog(tmp_path / "events.jsonl", hooks=[seen.append, broken]) as log:
        for i in range(3):
            log.append(make(replica=f"r{i}"))
    assert [r.replica for r in seen] == ["r0", "r1", "r2"]
    assert log.hook_errors == 3
    assert log.last_hook_error is not None and "exporter down" in log.last_hook_error
    assert len(read_start_records(tmp_path / "events.jsonl")) == 3


def test_events_reexports_the_pure_records() -> None:
    """``telemetry.events`` re-exports the record names of the pure ``telemetry.records``."""
    from preheat.telemetry import events, records

    for name in records.__all__:
        assert getattr(events, name) is getattr(records, name), name
    assert set(records.__all__) <= set(events.__all__)
