"""Telemetry overhead: per replica start, and per routed request.

Targets (issue 6): recording and exporting a ``StartRecord`` adds under 1% to a start,
and a ``RouteDecision`` record costs under 10 us per routed request.

Start side, in the same run:
  baseline  a real warm start of the simulated engine (``preheat engine serve --snapshot``
            on a generated model in a local directory) until /health answers 200 and a
            first completion returns: the fastest start there is, so the strictest ratio;
  measured  what the fleet does per start: classify_start + StartRecord + EventLog.append
            (with and without fsync) + TelemetryMetrics.observe_start; and separately one
            /metrics exposition (a scrape, which happens per scrape interval, not per start).

Request side, in the same run:
  baseline  the prefix_aware policy's own choose() on a 6 KiB chat prompt, 4 instances;
  measured  per request: RouteDecision(...) + DecisionLog.sampled() (+ write when sampled)
            + TelemetryMetrics.observe_route, at sample rates 1.0, 0.1 and 0.01.

Usage:  .venv/bin/python benchmarks/telemetry_overhead.py [--starts 5] [--requests 50000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from preheat.bench.models import generate_model
from preheat.router.policies import Instance, PolicyParams, RouteRequest, make_policy
from preheat.runtime.procs import free_port, start_process, wait_http
from preheat.telemetry.classify import StartContext, StartReason, classify_start
from preheat.telemetry.events import EventClass, EventLog, StartRecord
from preheat.telemetry.prometheus import TelemetryMetrics
from preheat.telemetry.routing import DecisionLog, RouteDecision
from preheat.telemetry.stats import percentile

PREHEAT = str(Path(sys.executable).parent / "preheat")


def warm_engine_start(snapshot: Path) -> float:
    """Seconds from spawn to a first completion of a simulated engine on a local snapshot
    (started like the fleet starts one: the parent-death launcher, its own session)."""
    port = free_port()
    t0 = time.perf_counter()
    proc = start_process(
        [
            PREHEAT,
            "engine",
            "serve",
            "--port",
            str(port),
            "--snapshot",
            str(snapshot),
            "--time-scale",
            "0",
        ]
    )
    try:
        if not wait_http(f"http://127.0.0.1:{port}/health", timeout=60, child=proc, interval=0.005):
            raise RuntimeError(f"engine not healthy within 60 s (exit code {proc.returncode})")
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"prompt": "preheat warm-up", "max_tokens": 1}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
        return time.perf_counter() - t0
    finally:
        proc.stop(10)


def per_start_telemetry(tmp: Path, n: int, *, fsync: bool) -> tuple[float, float]:
    """Mean and p99 seconds of classify + record + append + observe, per start."""
    metrics = TelemetryMetrics()
    times = []
    with EventLog(tmp / f"events-{fsync}.jsonl", fsync=fsync) as log:
        for i in range(n):
            t0 = time.perf_counter()
            now = time.time()
            cls = classify_start(
                StartContext(StartReason.SCALE_OUT, node_had_revision=True, node_is_new=False)
            )
            rec = StartRecord(
                endpoint="chat",
                variant="main",
                replica=f"chat-main-{i}",
                node="node-1",
                revision="rev-1",
                event_class=cls,
                scheduled=now,
                weights_ready=now + 0.01,
                runtime_started=now + 0.02,
                weights_loaded=now + 1.0,
                healthy=now + 1.1,
                first_response=now + 1.2,
                weights_source="cache",
                bytes_from={"cache": 2 * 1024**3},
            )
            log.append(rec)
            metrics.observe_start(rec)
            times.append(time.perf_counter() - t0)
    return statistics.fmean(times), percentile(times, 99)


def scrape_seconds(n: int = 50) -> float:
    metrics = TelemetryMetrics()
    for r in range(120):  # a fleet's worth of history: every class and stage populated
        now = 1.7e9 + r
        metrics.observe_start(
            StartRecord(
                "chat",
                "main",
                f"r{r}",
                f"n{r % 8}",
                "rev",
                list(EventClass)[r % 6],
                now,
                now + 0.1,
                now + 0.2,
                now + 0.3,
                now + 1.0,
                now + 1.1,
                now + 1.2,
            )
        )
    t0 = time.perf_counter()
    for _ in range(n):
        metrics.exposition()
    return (time.perf_counter() - t0) / n


def policy_baseline(n: int) -> float:
    """Mean seconds of prefix_aware choose() for a 6 KiB chat prompt over 4 instances."""
    rng = random.Random(1)
    policy = make_policy(
        "prefix_aware", PolicyParams(), salt=b"preheat-bench-salt-0123456789", rng=rng
    )
    instances = [Instance(f"http://127.0.0.1:{8000 + i}") for i in range(4)]
    docs = ["".join(rng.choice("abcdefghij ") for _ in range(6000)) for _ in range(32)]
    reqs = [
        RouteRequest(
            request_id=str(i),
            body={
                "messages": [
                    {"role": "system", "content": docs[i % 32]},
                    {"role": "user", "content": f"question {i}"},
                ]
            },
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    for r in reqs:
        policy.choose(r, instances)
    return (time.perf_counter() - t0) / n


def per_request_telemetry(tmp: Path, n: int, rate: float) -> tuple[float, float, float]:
    """Mean, p50 and p99 seconds per request of decision record + sampled write + observe."""
    metrics = TelemetryMetrics()
    log = DecisionLog(tmp / f"decisions-{rate}.jsonl", rate, rng=random.Random(2))
    instances = [f"http://127.0.0.1:{8000 + i}" for i in range(4)]
    times = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            d = RouteDecision(
                ts=time.time(),
                request_id=f"req-{i}",
                variant="main",
                strategy="prefix_aware",
                instance=instances[i & 3],
                rank=0,
                outcome="affinity",
                matched_blocks=2,
                prefix_blocks=3,
                predicted_cached_tokens=1024,
                actual_cached_tokens=1008,
                prompt_tokens=1500,
                decision_us=12.5,
            )
            if log.sampled():
                log.write(d)
            metrics.observe_route(d)
            times.append(time.perf_counter() - t0)
    finally:
        log.close()
    return statistics.fmean(times), percentile(times, 50), percentile(times, 99)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--starts", type=int, default=5, help="real warm engine starts to time")
    ap.add_argument("--records", type=int, default=2000, help="telemetry records per start case")
    ap.add_argument("--requests", type=int, default=50_000, help="routed requests per rate")
    args = ap.parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"loadavg at start: {' '.join(load)}")
    with tempfile.TemporaryDirectory(prefix="preheat-telemetry-bench-") as d:
        tmp = Path(d)
        model = tmp / "model"
        generate_model(model, 64 * 1024**2, shards=4, seed=1)
        warm = [warm_engine_start(model) for _ in range(args.starts)]
        warm_p50 = percentile(warm, 50)
        print(
            f"\n[start] warm engine start (spawn -> first response), n={len(warm)}: "
            f"p50 {warm_p50 * 1e3:.1f} ms, min {min(warm) * 1e3:.1f} ms"
        )
        for fsync in (False, True):
            mean, p99 = per_start_telemetry(tmp, args.records, fsync=fsync)
            print(
                f"[start] telemetry per start (fsync={fsync}): mean {mean * 1e6:.1f} us, "
                f"p99 {p99 * 1e6:.1f} us -> {100 * mean / warm_p50:.3f}% of the warm start "
                f"(p99: {100 * p99 / warm_p50:.3f}%)"
            )
        scrape = scrape_seconds()
        print(
            f"[start] one /metrics exposition with 6 classes x 6 stages: {scrape * 1e3:.2f} ms "
            f"({100 * scrape / warm_p50:.2f}% of a warm start; once per scrape interval)"
        )

        base = policy_baseline(min(args.requests, 20_000))
        print(
            f"\n[route] baseline prefix_aware choose(), 6 KiB prompt, 4 instances: "
            f"{base * 1e6:.1f} us/request"
        )
        for rate in (1.0, 0.1, 0.01):
            mean, p50, p99 = per_request_telemetry(tmp, args.requests, rate)
            verdict = "OK" if mean < 10e-6 else "OVER"
            print(
                f"[route] record + sampled JSONL (rate {rate}) + observe: mean "
                f"{mean * 1e6:.2f} us, p50 {p50 * 1e6:.2f} us, p99 {p99 * 1e6:.2f} us, {mean / base:.2f}x the policy's "
                f"choose() [{verdict} vs 10 us]"
            )


if __name__ == "__main__":
    main()
