"""`preheat sim routing` as a real command, trace replay, and the simulator against a live engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from preheat.bench.routing import drive, engine_counters
from preheat.bench.workloads import rag
from preheat.testing.engines import simulated_engines

PREHEAT = str(Path(sys.executable).parent / "preheat")
KEYS = (
    "requests", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms",
    "output_tokens_per_s", "kv_hit_rate", "shares", "max_share_over_mean", "decisions",
)  # fmt: skip


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PREHEAT, "sim", "routing", *args], capture_output=True, text=True, timeout=120
    )


def test_routing_json_has_every_figure() -> None:
    """--json prints one object with the figures the issue promises, by outcome and instance."""
    out = _sim(
        "--instances", "3", "--profile", "tiny", "--policy", "prefix_aware",
        "--workload", "aws-8k", "--requests", "60", "--concurrency", "6", "--seed", "2",
        "--kv-blocks", "3000", "--set", "families=4", "--set", "max_tokens=8", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(KEYS) <= set(doc)
    assert doc["requests"] == 60 and len(doc["shares"]) == 3
    assert sum(doc["decisions"].values()) == 60
    assert 0.0 < doc["kv_hit_rate"] < 1.0


def test_bad_options_name_the_fix() -> None:
    """An unknown workload and a missing load model fail with what to give instead."""
    out = _sim("--instances", "2", "--profile", "tiny", "--policy", "random", "--workload", "x")
    assert out.returncode != 0 and "choose one of" in out.stderr
    out = _sim("--instances", "2", "--profile", "tiny", "--policy", "random", "--workload", "rag")
    assert out.returncode != 0 and "--concurrency" in out.stderr
    out = _sim(*base_rag(), "--set", "families")
    assert out.returncode != 0 and "KEY=NUMBER" in out.stderr
    out = _sim(*base_rag(), "--set", "nope=3")
    assert out.returncode != 0 and "nope" in out.stderr


def base_rag() -> tuple[str, ...]:
    return ("--instances", "2", "--profile", "tiny", "--policy", "random", "--workload", "rag",
            "--concurrency", "2", "--requests", "5")  # fmt: skip


def test_trace_replay_timed_and_closed_loop(tmp_path: Path) -> None:
    """A JSONL trace replays at its own times, or closed loop without them; bad lines are named."""
    bodies = [
        {"messages": [{"role": "system", "content": "shared " * 300},
                      {"role": "user", "content": f"question {i}"}], "max_tokens": 8}
        for i in range(20)
    ]  # fmt: skip
    timed = tmp_path / "timed.jsonl"
    timed.write_text("\n".join(json.dumps({"t": i * 0.5, "body": b}) for i, b in enumerate(bodies)))
    plain = tmp_path / "plain.jsonl"
    plain.write_text("# a comment\n" + "\n".join(json.dumps(b) for b in bodies) + "\n")
    base = ("--instances", "2", "--profile", "tiny", "--policy", "prefix_aware", "--json")
    a = json.loads(_sim(*base, "--trace", str(timed)).stdout)
    assert a["requests"] == 20 and a["virtual_s"] >= 9.5  # last arrival at 9.5 s
    assert a["kv_hit_rate"] > 0.8
    b = json.loads(_sim(*base, "--trace", str(plain), "--concurrency", "4").stdout)
    assert b["requests"] == 20 and b["virtual_s"] < 2.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(bodies[0]) + "\n{not json\n")
    out = _sim(*base, "--trace", str(bad), "--concurrency", "1")
    assert out.returncode != 0 and "bad.jsonl:2" in out.stderr


def test_kv_hits_equal_the_live_engines_counters(tmp_path: Path) -> None:
    """The same stream, one request at a time, gives the simulator exactly the hits and
    lookups a live simulated engine counts in its /metrics (with evictions: 400 blocks)."""
    items = rag(40, documents=4, doc_chars=3000, max_tokens=8, seed=4)
    trace = tmp_path / "rag.jsonl"
    trace.write_text("\n".join(json.dumps(i.body) for i in items))
    with simulated_engines(
        1, time_scale=0.0, kv_blocks=400, model_name="m", log_dir=tmp_path
    ) as es:
        url = es[0].url
        before = asyncio.run(engine_counters([url]))[url]
        outcomes, _ = asyncio.run(drive(url, items, concurrency=1))
        after = asyncio.run(engine_counters([url]))[url]
    assert all(o.status == 200 for o in outcomes)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    out = _sim(
        "--instances", "1", "--profile", "tiny", "--kv-blocks", "400", "--policy", "random",
        "--trace", str(trace), "--concurrency", "1", "--json",
    )  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["kv_hit_rate"] == hits / queries
    assert 0.2 < hits / queries < 1.0
