"""The fleet simulator at scale: decision cost by fleet size, routing at 64 and 512
instances, and the 1M-request x 128-instance run (CPU seconds of one process).

    .venv/bin/python benchmarks/sim_scale.py decision --sizes 8,64,128,512 [--no-remember]
    .venv/bin/python benchmarks/sim_scale.py table --sizes 64,512
    .venv/bin/python benchmarks/sim_scale.py million --requests 1000000 --instances 128
    .venv/bin/python benchmarks/sim_scale.py million --requests 1000000 --compiled

``--compiled`` runs on the mypyc-compiled copy of the hot modules that
``benchmarks/compiled.py`` builds (or reuses) under ``~/.cache/preheat/compiled/``.
``--pypy`` runs this script again under ``pypy3`` through ``benchmarks/pypy.py`` (the
same source, with the few 3.11-only spellings patched for PyPy's Python 3.9).

Times are ``time.process_time`` (CPU of this process: what one core spends) next to
wall time; on a shared machine wall time also counts the other processes' turns. On
PyPy the result also has ``gc_s`` (the GC's time, ``gc.get_stats()``) and ``gc_minors``
(minor collections) during the simulation.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

from preheat.bench.workloads import aws_8k
from preheat.router.policies import Instance, PolicyParams, RouteRequest, make_policy
from preheat.sim.routing import SHARED_PREFIX_KEYS, RoutingConfig, SimItem, simulate_routing
from preheat.timing import get_profile

SALT = b"preheat-sim-scale-benchmark-salt"


def items_for(n: int, **kw: Any) -> tuple[list[SimItem], float]:
    t0 = time.process_time()
    work = aws_8k(n, **kw)
    items = [SimItem(w.request_id, w.path, w.body, w.after) for w in work]
    return items, time.process_time() - t0


def decision(args: argparse.Namespace) -> dict[str, Any]:
    """CPU per decision (choose + on_sent + on_done) for each fleet size and policy."""
    items, _ = items_for(args.requests, families=200, seed=args.seed)
    out: dict[str, Any] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        for strategy, placement in (("random", "learned"), ("prefix_aware", "stable-move"),
                                    ("prefix_aware", "stable"), ("prefix_aware", "learned"),
                                    ("prefix_aware", "hybrid"), ("prefix_aware", "hash")):  # fmt: skip
            pol = make_policy(
                strategy, PolicyParams(placement=placement), salt=SALT, rng=random.Random(1)
            )
            hasher = getattr(pol, "hasher", None)
            if hasher is not None and not args.no_remember:  # as simulate_routing does
                hasher.remember_parts(SHARED_PREFIX_KEYS)
            inst = [Instance(f"http://10.0.{j // 250}.{j % 250}:8000") for j in range(size)]
            rng = random.Random(2)
            for i in inst:  # a loaded fleet: 0-7 requests in flight each
                i.in_flight = rng.randrange(8)
            t0 = time.process_time()
            for it in items:
                rr = RouteRequest(it.request_id, body=it.body)
                c = pol.choose(rr, inst)
                pol.on_sent(rr, c)
                pol.on_done(rr, c, ok=True, cached_tokens=0)
            us = (time.process_time() - t0) / len(items) * 1e6
            name = strategy if strategy == "random" else f"{strategy}/{placement}"
            out[f"{size}/{name}"] = us
            print(f"{size:5d} instances  {name:22s} {us:8.1f} us CPU per decision")
    return out


def _gc_meter() -> Any:
    """On PyPy: a function giving the GC's seconds and minor collections since this call
    (``gc.get_stats()``, ``gc.hooks``); None elsewhere."""
    if sys.implementation.name != "pypy":
        return None
    import gc

    minors = [0]

    def on_minor(stats: Any) -> None:
        minors[0] += stats.count

    gc.hooks.on_gc_minor = on_minor
    t0 = gc.get_stats().total_gc_time  # ms

    def read() -> dict[str, Any]:
        gc.hooks.on_gc_minor = None
        return {"gc_s": (gc.get_stats().total_gc_time - t0) / 1000.0, "gc_minors": minors[0]}

    return read


def run(items: list[SimItem], cfg: RoutingConfig, prof: Path | None = None) -> dict[str, Any]:
    pr = cProfile.Profile() if prof else None
    meter = _gc_meter()
    w0, c0 = time.perf_counter(), time.process_time()
    if pr:
        pr.enable()
    res = simulate_routing(items, cfg, policy_rng=random.Random(1))
    if pr:
        pr.disable()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    s = res.summary()
    s.pop("shares")
    s |= {"cpu_s": cpu, "wall_s": wall, "cpu_us_per_request": cpu / len(items) * 1e6}
    if meter is not None:
        s |= meter()
    if pr and prof:
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
        prof.write_text(buf.getvalue())
    return s


def _row(label: str, s: dict[str, Any]) -> None:
    print(
        f"{label:28s} TTFT p50 {s['ttft_p50_ms']:8.1f} p90 {s['ttft_p90_ms']:8.1f} ms  "
        f"{s['output_tokens_per_s']:9.0f} tok/s  hit {s['kv_hit_rate']:.3f}  "
        f"max/mean {s['max_share_over_mean']:.2f}  cpu {s['cpu_s']:.0f} s "
        f"({s['cpu_us_per_request']:.0f} us/req)  {s['decisions']}"
        + (f"  gc {s['gc_s']:.1f} s, {s['gc_minors']} minors" if "gc_s" in s else "")
    )


def table(args: argparse.Namespace) -> dict[str, Any]:
    """random vs prefix_aware at each fleet size, load and families scaled with it."""
    out: dict[str, Any] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        fam = 8 * size
        items, gen = items_for(
            64 * size, families=fam, prefix_tokens=2000, suffix_tokens=50, max_tokens=32,
            seed=args.seed,
        )  # fmt: skip
        for strategy in ("random", "prefix_aware"):
            cfg = RoutingConfig(
                instances=size,
                profile=get_profile(args.profile),
                policy=strategy,
                kv_blocks=args.kv_blocks,
                concurrency=4 * size,
            )
            s = run(items, cfg)
            out[f"{size}/{strategy}"] = s | {"generate_cpu_s": gen}
            _row(f"{size} x {strategy}", s)
    return out


def million(args: argparse.Namespace) -> dict[str, Any]:
    """The big run: many requests over many instances, with a cProfile of a slice."""
    kw = {"families": args.families, "prefix_tokens": 512, "suffix_tokens": 16,
          "max_tokens": args.max_tokens, "seed": args.seed}  # fmt: skip
    items, gen = items_for(args.requests, **kw)
    print(f"generated {len(items)} requests in {gen:.0f} s CPU")
    cfg = RoutingConfig(
        instances=args.instances,
        profile=get_profile(args.profile),
        policy=args.policy,
        kv_blocks=args.kv_blocks,
        concurrency=8 * args.instances,
    )
    s = run(items, cfg, args.profile_out)
    _row(f"{len(items)} x {args.instances} {args.policy}", s)
    return s | {"generate_cpu_s": gen, "workload": kw}


def _on_compiled(argv: list[str]) -> None:
    """Run this script again with the compiled copy first on ``PYTHONPATH``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compiled import build

    where = build()
    env = os.environ | {"PYTHONPATH": str(where), "PREHEAT_COMPILED": str(where)}
    os.execve(sys.executable, [sys.executable, __file__, *argv], env)


def _on_pypy(argv: list[str]) -> None:
    """Run this script again under ``pypy3`` with ``benchmarks/pypy.py``'s patches."""
    loader = str(Path(__file__).resolve().parent / "pypy.py")
    argv = [a for a in argv if a != "--pypy"]
    os.execvp("pypy3", ["pypy3", loader, __file__, *argv])


def _check_compiled() -> str | None:
    where = os.environ.get("PREHEAT_COMPILED")
    if where is None:
        return None
    import preheat.kvcache
    import preheat.sim.routing

    for mod in (preheat.kvcache, preheat.sim.routing):
        if not (mod.__file__ or "").startswith(where) or not (mod.__file__ or "").endswith(".so"):
            raise SystemExit(f"--compiled: {mod.__name__} came from {mod.__file__}, not {where}")
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("decision", "table", "million"))
    ap.add_argument("--sizes", default="8,64,128,512")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--instances", type=int, default=128)
    ap.add_argument("--policy", default="prefix_aware")
    ap.add_argument("--profile", default="llama-3.1-70b-8xh100")
    ap.add_argument("--kv-blocks", type=int, default=16384)
    ap.add_argument("--families", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile-out", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--compiled", action="store_true", help="run on the mypyc-compiled copy")
    ap.add_argument("--pypy", action="store_true", help="run under pypy3 (benchmarks/pypy.py)")
    ap.add_argument(
        "--no-remember",
        action="store_true",
        help="decision: hash every prompt (the proxy's way) instead of reusing shared prefixes",
    )
    args = ap.parse_args()
    if args.pypy and args.compiled:
        raise SystemExit("--pypy and --compiled exclude each other")
    if args.pypy and sys.implementation.name != "pypy":
        _on_pypy(sys.argv[1:])
    if args.compiled and "PREHEAT_COMPILED" not in os.environ:
        _on_compiled(sys.argv[1:])
    compiled = _check_compiled()
    code = f"compiled {compiled}" if compiled else "pure Python"
    print(f"code: {code} on {sys.implementation.name} {sys.version.split()[0]}")
    print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    result = {"decision": decision, "table": table, "million": million}[args.what](args)
    result["compiled"] = compiled
    result["implementation"] = sys.implementation.name
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json),
                                         "profile_out": str(args.profile_out)},
                                         "result": result}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
