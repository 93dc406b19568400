"""`preheat demo --json --out DIR` end to end, on a small model so it runs in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from preheat.telemetry.events import read_start_records

pytestmark = pytest.mark.timeout(240)


def test_demo_json_summary_report_and_events(tmp_path: Path) -> None:
    """The demo prints the documented JSON summary, writes events and the HTML report, and
    shows what it promises: warm starts beat cold ones, a one-shard change moves one shard
    per node, prefix-aware routing hits the KV cache more often than random."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from preheat.cli import main; main()",
            "demo",
            "--json",
            "--out",
            str(out),
            "--size",
            "16MiB",
            "--bandwidth",
            "8MiB",
            "--requests",
            "80",
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert s["model_bytes"] >= 16 * 1024**2
    cold, warm = s["readiness_seconds"]["cold"], s["readiness_seconds"]["warm"]
    # The cold start is the fleet's first copy: no node holds the model, no peer helps.
    assert cold["weights_source"] == "origin" and cold["bytes_from_origin"] == s["model_bytes"]
    assert cold["bytes_from_peer"] == 0
    assert "no node holds the model yet" in " ".join(proc.stderr.split())
    assert warm["weights_source"] == "cache" and warm["bytes_from_origin"] == 0
    assert set(cold["stages"]) >= {"weights_ready", "runtime_started", "healthy"}
    # 16 MiB at 8 MiB/s: the cold download alone takes about 2 s (the limiter has no
    # burst: 32 MiB took 4.0 s). Every warm-up runs at that rate too, so the model is small.
    assert cold["stages"]["weights_ready"] > 1.5
    # The warm start skips that download; the rest (engine start) is alike, and slow
    # alike on a loaded machine, so compare by difference, not ratio.
    assert cold["ready"] > warm["ready"] + 1.0
    # the changed shard crosses the origin once; peers carry it to the other nodes
    assert s["rollout_bytes_fetched"] == s["rollout_changed_shard_bytes"]
    assert s["readiness_seconds"]["new_node"]["node"] == "node-4"
    routing = s["routing"]
    assert set(routing) == {"random", "prefix_aware"}
    for r in routing.values():
        assert r["failed"] == 0
        assert {"ttft_p50_ms", "ttft_p90_ms", "kv_hit_rate", "shares"} <= set(r)
        assert len(r["shares"]) == 4 and abs(sum(r["shares"].values()) - 1) < 0.01
    assert routing["prefix_aware"]["kv_hit_rate"] > routing["random"]["kv_hit_rate"]
    # The router's sampled decision log: the engine's cached_tokens next to the
    # router's prediction, for both strategies.
    decisions = [
        json.loads(line)
        for line in (out / "route_decisions.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert s["route_decisions"] == str(out / "route_decisions.jsonl")
    assert {d["strategy"] for d in decisions} == {"random", "prefix_aware"}
    assert all(d["actual_cached_tokens"] is not None for d in decisions)
    assert all(d["prompt_tokens"] for d in decisions)
    aware = [d for d in decisions if d["strategy"] == "prefix_aware"]
    assert sum(d["actual_cached_tokens"] for d in aware) > 0
    assert sum(d["predicted_cached_tokens"] or 0 for d in aware) > 0
    # The report: start times, inventory and the routing part, each plot on disk.
    page = (out / "report" / "index.html").read_text()
    for png in (
        "readiness_cdf.png",
        "inventory.png",
        "route_share.png",
        "kv_hit_rate.png",
        "predicted_vs_actual.png",
    ):
        assert (out / "report" / png).stat().st_size > 0, png
        assert f'<img src="{png}"' in page, png
    for table in ("inventory", "routing-summary", "routing"):
        assert f'class="{table}"' in page, table
    for strategy in ("random", "prefix_aware"):
        assert f"<td>{strategy}</td>" in page
    records = read_start_records(out / "events.jsonl")
    classes = {r.event_class.value for r in records}
    assert {"new_node", "scale_out", "new_version"} <= classes
    assert not (out / "work").exists()  # the stores are cleaned up without --keep
