"""The HTML report and `preheat report`: files on disk, self-contained page, real CLI process."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

from matplotlib.image import imread

from preheat.telemetry.events import EventClass, EventLog
from preheat.telemetry.inventory import NodeInventory, SnapshotEntry, WarmupFailure
from preheat.telemetry.report import write_report
from preheat.telemetry.routing import DecisionLog, RouteDecision, read_decisions, routing_stats
from preheat.telemetry.stats import stage_table
from preheat.testing.telemetry import synthetic_route_decisions, synthetic_starts

PREHEAT = str(Path(sys.executable).parent / "preheat")


def _inventory() -> list[NodeInventory]:
    return [
        NodeInventory(
            "node-0",
            free_bytes=6 * 1024**3,
            snapshots=(SnapshotEntry("rev-1", 2 * 1024**3, 1.7e9, False, 0, ("chat-main-0",)),),
            capacity_bytes=8 * 1024**3,
            ready={"rev-1": True},
        ),
        NodeInventory(
            "node-1",
            free_bytes=256 * 1024**2,
            last_warmup_failure=WarmupFailure(
                "rev-1", "disk holds 0.3 GiB, model needs 2 GiB", 1.7e9
            ),
        ),
    ]


def test_report_files_are_self_contained_and_complete(tmp_path: Path) -> None:
    """index.html links only local PNGs that exist and decode; tables hold every class."""
    records = synthetic_starts(48, seed=7, failures=1)
    decisions = tmp_path / "decisions.jsonl"
    synthetic_route_decisions(decisions, 300, seed=7)
    out = tmp_path / "report"
    index = write_report(
        records,
        out,
        route_decisions_path=decisions,
        inventory=_inventory(),
        routing_summary={"random": {"ttft_p50_ms": 210.0}, "prefix_aware": {"ttft_p50_ms": 95.0}},
    )
    assert index == out / "index.html"
    page = index.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(srcs) == sorted(
        [
            "readiness_cdf.png",
            "stage_breakdown.png",
            "cache_hit_ratio.png",
            "inventory.png",
            "route_share.png",
            "kv_hit_rate.png",
            "predicted_vs_actual.png",
        ]
    )
    for src in srcs:
        img = imread(out / src)
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img.std() > 0.01, f"{src} is blank"
    # Nothing loaded from elsewhere: no external scripts, styles, fonts or images.
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<link" not in page and "<script src" not in page
    for cls in EventClass:
        assert f'data-class="{cls.value}"' in page
    ready_p99 = {r.event_class: r.seconds.p99 for r in stage_table(records) if r.stage == "ready"}
    assert f"{ready_p99[EventClass.NEW_NODE]:.2f} s" in page
    assert "engine exited with code 1" in page  # the failed start is listed with its reason
    assert "disk holds 0.3 GiB" in page
    assert "prefix_aware" in page and "95.0" in page


def test_report_without_data_says_so(tmp_path: Path) -> None:
    """No records and no decisions: a page that says so, with no broken images."""
    index = write_report([], tmp_path / "r")
    page = index.read_text()
    assert "No start records" in page
    assert "<img" not in page


def test_cli_prints_table_and_writes_report(tmp_path: Path) -> None:
    """`preheat report` prints p50/p95/p99 per class and stage and writes the page."""
    events = tmp_path / "events.jsonl"
    records = synthetic_starts(18, seed=8)
    with EventLog(events) as log:
        for r in records:
            log.append(r)
    with open(events, "a") as f:
        f.write('{"v":1,"endpoint":"chat","vari')  # a torn line from a killed writer
    decisions = tmp_path / "decisions.jsonl"
    synthetic_route_decisions(decisions, 40, seed=8)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            PREHEAT,
            "report",
            "--events",
            str(events),
            "--decisions",
            str(decisions),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    for cls in EventClass:
        assert cls.value in proc.stdout
    assert "p95" in proc.stdout and "weights_ready" in proc.stdout
    assert "skipped 1 torn line" in proc.stdout
    assert (out / "index.html").is_file()
    assert (out / "kv_hit_rate.png").is_file()


def test_cli_json_and_bad_input(tmp_path: Path) -> None:
    """--json prints the percentiles; a missing file exits 1 naming the file and the fix."""
    events = tmp_path / "events.jsonl"
    with EventLog(events) as log:
        for r in synthetic_starts(6, seed=9):
            log.append(r)
    proc = subprocess.run(
        [PREHEAT, "report", "--events", str(events), "--out", str(tmp_path / "o"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["records"] == 6
    assert {row["event_class"] for row in data["stages"]} == {c.value for c in EventClass}
    missing = subprocess.run(
        [PREHEAT, "report", "--events", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1
    assert "nope.jsonl" in missing.stderr and "--events" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"endpoint": "chat"}\n')
    proc = subprocess.run(
        [PREHEAT, "report", "--events", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "bad.jsonl:1" in proc.stderr


def test_report_reads_the_routers_decision_log(tmp_path: Path) -> None:
    """Lines written by the router's DecisionLog feed the routing section as they are."""
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, 1.0, rng=random.Random(0))
    try:
        for i in range(40):
            log.write(
                RouteDecision(
                    ts=1.7e9 + i,
                    request_id=f"r{i}",
                    variant="main",
                    strategy="prefix_aware" if i % 2 else "random",
                    instance=f"http://127.0.0.1:{9000 + i % 3}",
                    rank=0,
                    outcome="affinity" if i % 2 else "random",
                    matched_blocks=i % 4,
                    prefix_blocks=4,
                    predicted_cached_tokens=None if i % 2 == 0 else 16 * (i % 4),
                    actual_cached_tokens=None if i == 5 else 16 * (i % 4),
                    prompt_tokens=None if i == 5 else 80,
                    decision_us=4.0 + i % 5,
                )
            )
    finally:
        log.close()
    rows = read_decisions(path)
    assert len(rows) == 40
    stats = {s.strategy: s for s in routing_stats(rows)}
    pa = stats["prefix_aware"]
    reported = [i for i in range(1, 40, 2) if i != 5]
    assert pa.kv_hit_rate == sum(16 * (i % 4) for i in reported) / (80 * len(reported))
    assert pa.predicted_hit_rate == pa.kv_hit_rate  # the prediction matched every time
    assert pa.mean_abs_error_tokens == 0
    assert abs(sum(pa.shares.values()) - 1.0) < 1e-9
    index = write_report([], tmp_path / "report", route_decisions_path=path)
    page = index.read_text()
    for png in ("route_share.png", "kv_hit_rate.png", "predicted_vs_actual.png"):
        assert f'src="{png}"' in page
        assert (tmp_path / "report" / png).is_file()
