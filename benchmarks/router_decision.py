"""Decision cost of the routing policies, in process: p50/p99 per decision.

64 instances with random in-flight counts; chat requests whose canonical prompt is about
32,000 characters (a popular document plus a unique question), so the whole prompt is
hashed with --prefix-length 32768. A decision is ``choose`` + ``on_sent`` (the learned
index update, with each instance's LRU modelled at --kv-tokens) and ``on_done``, timed with perf_counter_ns (percentiles interpolated, ``telemetry.stats.percentile``); the body is already parsed (the proxy's
JSON parse is part of the proxy-overhead benchmark). The 20,000 prepared bodies
(~640 MB of strings) are moved out of the cyclic GC's view with ``gc.freeze()`` before
timing, as the router freezes its start-up heap: otherwise every full collection walks
them and the p99 measures the benchmark's own heap (``--no-freeze`` shows that).

    .venv/bin/python benchmarks/router_decision.py --decisions 20000
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from preheat.bench.workloads import _vocab, text, zipf_weights
from preheat.router.policies import Instance, PolicyParams, RouteRequest, make_policy
from preheat.router.prefix import PrefixHasher, canonical, canonical_parts
from preheat.telemetry.stats import percentile

# The clock decisions are timed with: wall (perf_counter_ns) or this thread's CPU time
# (--clock cpu: on a loaded machine, the time the decision itself ran, not its waits).
_now = time.perf_counter_ns

SALT = b"benchmark-salt-0123456789abcdef"


def bodies(n: int, chars: int, docs: int, seed: int) -> list[dict]:  # type: ignore[type-arg]
    rng = random.Random(seed)
    vocab = _vocab(seed)
    documents = [text(rng, chars - 400, vocab) for _ in range(docs)]
    picks = rng.choices(range(docs), weights=zipf_weights(docs, 1.1), k=n)
    return [
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": f"{documents[d]}\n\nQ{i}: {text(rng, 300, vocab)}"},
            ],
        }
        for i, d in enumerate(picks)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--chars", type=int, default=32000)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--prefix-length", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    ap.add_argument("--no-freeze", action="store_true", help="leave the bodies to the GC")
    ap.add_argument("--block-chars", type=int, default=2048)
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=9600,
        help="KV capacity given to every instance (tokens; the LRU model runs; 0: none)",
    )
    ap.add_argument(
        "--placement",
        default=PolicyParams().placement,
        help="prefix_aware placement to time (default: the policy's default)",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this thread's CPU time (a loaded machine's waits left out)",
    )
    args = ap.parse_args()
    global _now
    _now = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    console = Console()
    console.print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    reqs = [
        RouteRequest(f"r{i}", body=b)
        for i, b in enumerate(bodies(args.decisions, args.chars, args.docs, args.seed))
    ]
    chars = sum(len(canonical(r.body)[0]) for r in reqs[:100]) / 100  # type: ignore[arg-type]
    gc.collect()
    if not args.no_freeze:
        gc.freeze()
    table = Table(
        title=f"{args.decisions} decisions, {args.instances} instances, ~{chars:.0f}-char prompts"
    )
    for col in ("policy", "p50 us", "p90 us", "p99 us", "max us"):
        table.add_column(col, justify="right")
    rng = random.Random(args.seed)
    fleet = [Instance(f"http://10.0.{i // 250}.{i % 250}:8000") for i in range(args.instances)]
    params = PolicyParams(
        prefix_length=args.prefix_length, block_chars=args.block_chars, placement=args.placement
    )
    results = {}
    runs = [
        ("random", params),
        ("least_outstanding", params),
        (
            "prefix_aware",
            PolicyParams(
                prefix_length=8192, block_chars=args.block_chars, placement=args.placement
            ),
        ),
        ("prefix_aware", params),
    ]
    for name, prm in runs:
        label = f"{name} (prefix_length {prm.prefix_length})" if name == "prefix_aware" else name
        policy = make_policy(name, prm, salt=SALT, rng=random.Random(args.seed))
        for inst in fleet:
            policy.set_capacity(inst.id, args.kv_tokens or None)
        times = []
        gc.collect()
        if args.no_gc:
            gc.disable()
        for r in reqs:
            for inst in fleet:  # churn the loads a little, like live traffic
                inst.in_flight = rng.randrange(6)
            t0 = _now()
            c = policy.choose(r, fleet)
            policy.on_sent(r, c)
            policy.on_done(r, c, ok=True, cached_tokens=None)
            times.append((_now() - t0) / 1000)
        times.sort()
        results[label] = times
        table.add_row(
            label, *(f"{percentile(times, q):.1f}" for q in (50, 90, 99)), f"{times[-1]:.0f}"
        )
    # The parts of a prefix_aware decision.
    hasher = PrefixHasher(SALT, params.block_chars)
    texts = [canonical_parts(r.body) for r in reqs[:2000]]  # type: ignore[arg-type]
    parts = {}
    t_canon = []
    for r in reqs[:2000]:
        t0 = _now()
        canonical_parts(r.body)  # type: ignore[arg-type]
        t_canon.append((_now() - t0) / 1000)
    for pl in sorted({8192, args.prefix_length}):
        t_hash = []
        for pieces, ends, total in texts:
            t0 = _now()
            hasher.chain_parts(pieces, total, pl, boundaries=ends)
            t_hash.append((_now() - t0) / 1000)
        parts[f"keyed chain hash, {pl} chars"] = sorted(t_hash)
    parts["canonical text (pieces, not joined)"] = sorted(t_canon)
    for name, xs in parts.items():
        table.add_row(
            f"  part: {name}", *(f"{percentile(xs, q):.1f}" for q in (50, 90, 99)), f"{xs[-1]:.0f}"
        )
    console.print(table)
    for label, times in results.items():
        if label.startswith("prefix_aware"):
            p99 = percentile(times, 99)
            console.print(
                f"{label}: p99 {p99:.1f} us, {'meets' if p99 <= 50 else 'misses'} the 50 us "
                f"target; AWS reports 1,300-1,900 us per request "
                f"({1300 / p99:.0f}-{1900 / p99:.0f}x this)"
            )


if __name__ == "__main__":
    main()
