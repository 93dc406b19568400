"""Latency a router adds in front of fast backends on 127.0.0.1, side by side with peers.

Two fast fake OpenAI backends (own processes, uvloop) answer at once. Non-streaming
/v1/completions requests (a ~1,800-character prompt from a few shared prefixes) go
through each router: preheat random vs sglang-router and vllm-router random, preheat
prefix_aware vs their cache_aware (like with like, never across). Peers run with their
default retries.

Added latency is paired: every request of the stream is sent directly to a backend
(round robin) and through the router, back to back by the same worker, the order
alternating per request; the added latency at p50/p99 is that percentile of the
per-request differences (router - direct), so added p99 >= added p50. ``--concurrency``
workers do this at once, so that many requests are in flight across the two paths.
The "p99 difference" column is routed p99 - direct p99, a difference of percentiles
(it can be below added p50 when the tails do not line up) shown for reference only.
"req/s" is a second pass of the same stream through the router alone with the same
number of workers (the one client process is part of what limits it, the same for
every router); "CPU ms/req" is the router's CPU time (its process and children, from
/proc) during that pass over the requests, a figure the machine's load moves less than
latency. ``preheataiohttp-<policy>`` runs preheat with ``--front aiohttp`` (the
previous server) and ``preheatbase-<policy>`` the ``preheat`` executable given with
``--baseline`` (another checkout's venv: the code before a change, run without this
process's ``PYTHONPATH``) for a before/after in the same run; run this script with
``PYTHONPATH=src`` from a worktree so that ``preheat-<policy>`` runs the worktree's code.

    .venv/bin/python benchmarks/router_overhead.py --requests 2000
    .venv/bin/python benchmarks/router_overhead.py --baseline /work/main/.venv/bin/preheat \
        --routers preheatbase-random,preheat-random,sglang-random
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from preheat.bench.compare import AddedLatency, counterparts, paired_added
from preheat.testing.procs import start_server
from preheat.testing.routers import (
    DEFAULT_SALT,
    RouterProcess,
    launch_router,
    start_fast_backend,
    start_peer_router,
)

ROUTERS = (
    "preheat-random",
    "sglang-random",
    "vllm-random",
    "preheat-prefix_aware",
    "sglang-cache_aware",
    "vllm-cache_aware",
)
HEADERS = {"Content-Type": "application/json"}


def bodies(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    shared = ["".join(rng.choice("abcdefgh ijklm") for _ in range(1800)) for _ in range(8)]
    return [
        json.dumps(
            {"model": "fake", "prompt": rng.choice(shared) + f" question {i}", "max_tokens": 3}
        ).encode()
        for i in range(n)
    ]


async def _post(s: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, int]:
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", data=body, headers=HEADERS) as r:
        await r.read()
    return time.perf_counter() - t0, r.status


async def measure_paired(
    direct: list[str], router: str, data: list[bytes], concurrency: int
) -> tuple[list[float], list[float], int]:
    """(direct seconds, routed seconds, failed pairs): request i sent both ways by one
    worker, back to back, direct first on even i; a pair with a non-200 on either side
    is left out and counted."""
    d_out: list[float] = []
    r_out: list[float] = []
    failed = 0
    it = iter(enumerate(data))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(concurrency):  # warm up the connections on both paths
            for u in (*direct, router):
                await _post(s, u, data[0])

        async def worker() -> None:
            nonlocal failed
            for i, body in it:
                d_url = direct[i % len(direct)]
                if i % 2 == 0:
                    d, ds = await _post(s, d_url, body)
                    r, rs = await _post(s, router, body)
                else:
                    r, rs = await _post(s, router, body)
                    d, ds = await _post(s, d_url, body)
                if ds != 200 or rs != 200:
                    failed += 1
                    continue
                d_out.append(d)
                r_out.append(r)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return d_out, r_out, failed


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


async def measure_throughput(router: str, data: list[bytes], concurrency: int) -> tuple[float, int]:
    """(requests per second, failures): the stream through the router alone,
    ``concurrency`` workers back to back, after one warm-up request per worker."""
    failed = 0
    it = iter(data)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(_post(s, router, data[0]) for _ in range(concurrency)))

        async def worker() -> None:
            nonlocal failed
            for body in it:
                _, status = await _post(s, router, body)
                failed += status != 200

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return len(data) / wall, failed


@contextlib.contextmanager
def router(
    name: str, backends: list[str], logdir: Path, baseline: str | None = None
) -> Iterator[RouterProcess]:
    kind, policy = name.split("-", 1)
    if kind == "preheatbase":
        if not baseline:
            raise SystemExit(f"{name} needs --baseline PATH (a preheat executable)")
        exe = baseline

        def argv(p: int) -> list[str]:
            cmd = [exe, "router", "serve", "--port", str(p), "--strategy", policy]
            return [
                *cmd,
                *(a for b in backends for a in ("--backend", b)),
                "--log-level",
                "WARNING",
            ]

        # Not this process's PYTHONPATH: run with it (``PYTHONPATH=src`` for a worktree's
        # code) the baseline would import the new code too, not its own install.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PREHEAT_ROUTER_SALT"] = DEFAULT_SALT
        proc, port = start_server(
            argv,
            port=None,
            log=logdir / f"{name}.log",
            env=env,
            inherit_env=False,
            timeout=60,
            what=name,
        )
        try:
            yield RouterProcess(process=proc, port=port)
        finally:
            proc.stop(5)
    elif kind in ("preheat", "preheataiohttp"):
        front = ["--front", "aiohttp"] if kind == "preheataiohttp" else []
        r = launch_router(
            backends=backends,
            strategy=policy,
            log_path=logdir / f"{name}.log",
            extra_args=front,
        )
        try:
            yield r
        finally:
            r.stop()
    else:
        with start_peer_router(kind, backends, policy=policy, log_path=logdir / f"{name}.log") as r:
            yield r


def ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def ratio(a: float, b: float) -> str:
    """a / b as "1.23x"; no ratio when the peer's added latency is not positive (noise)."""
    return f"{a / b:.2f}x" if b > 0 else "no ratio: peer's figure <= 0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="per router and concurrency")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--baseline", help="a preheat executable run as preheatbase-<policy> (another checkout)"
    )
    args = ap.parse_args()
    console = Console()
    console.print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    logdir = Path("/tmp/router-overhead")
    logdir.mkdir(exist_ok=True)
    data = bodies(args.requests, 1)
    names = args.routers.split(",")
    results: dict[int, dict[str, tuple[AddedLatency, int]]] = {}
    rates: dict[int, dict[str, tuple[float, int]]] = {}
    cpu: dict[int, dict[str, float]] = {}
    with start_fast_backend() as b1, start_fast_backend() as b2:
        backends = [b1.url, b2.url]
        for conc in (int(c) for c in args.concurrency.split(",")):
            res: dict[str, tuple[AddedLatency, int]] = {}
            rate: dict[str, tuple[float, int]] = {}
            cpu[conc] = {}
            for name in names:
                with router(name, backends, logdir, args.baseline) as r:
                    d, rt, failed = asyncio.run(measure_paired(backends, r.url, data, conc))
                    c0 = cpu_seconds(r.pid)
                    rate[name] = asyncio.run(measure_throughput(r.url, data, conc))
                    cpu[conc][name] = (cpu_seconds(r.pid) - c0) / len(data)
                res[name] = (paired_added(d, rt), failed)
            results[conc] = res
            rates[conc] = rate
    for conc, res in results.items():
        table = Table(title=f"concurrency {conc}, {args.requests} paired requests (ms)")
        cols = ("router", "direct p50", "routed p50", "routed p99", "added p50", "added p99")
        for col in (*cols, "p99 difference*", "failed pairs", "req/s", "failed", "CPU ms/req"):
            table.add_column(col, justify="right")
        for name, (a, failed) in res.items():
            table.add_row(
                name,
                ms(a.direct_p50),
                ms(a.routed_p50),
                ms(a.routed_p99),
                ms(a.added_p50),
                ms(a.added_p99),
                ms(a.p99_gap),
                str(failed),
                f"{rates[conc][name][0]:.0f}",
                str(rates[conc][name][1]),
                ms(cpu[conc][name]),
            )
        console.print(table)
        console.print(
            "  added p50/p99: percentiles of per-request (router - direct); "
            "*p99 difference: routed p99 - direct p99 (a difference of percentiles)"
        )
        for ours, peer in counterparts(res, [n for n in res if n.startswith("preheat")]):
            a, b = res[ours][0], res[peer][0]
            console.print(
                f"  c={conc}: {ours} vs {peer}: added p50 {ms(a.added_p50)} vs "
                f"{ms(b.added_p50)} ms ({ratio(a.added_p50, b.added_p50)}), added p99 "
                f"{ms(a.added_p99)} vs {ms(b.added_p99)} ms ({ratio(a.added_p99, b.added_p99)}), "
                f"req/s {rates[conc][ours][0]:.0f} vs {rates[conc][peer][0]:.0f} "
                f"({rates[conc][ours][0] / rates[conc][peer][0]:.2f}x)"
            )
        for name in res:
            base = name.replace("preheat-", "preheatbase-", 1)
            if name.startswith("preheat-") and base in res:
                a, b = res[name][0], res[base][0]
                console.print(
                    f"  c={conc}: {name} vs {base} (before): added p50 "
                    f"{ratio(a.added_p50, b.added_p50)}, p99 {ratio(a.added_p99, b.added_p99)}, "
                    f"req/s {rates[conc][name][0] / rates[conc][base][0]:.2f}x, CPU/req "
                    f"{cpu[conc][name] / cpu[conc][base]:.2f}x"
                )
    console.print(f"loadavg at end: {Path('/proc/loadavg').read_text().strip()}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    str(c): {
                        k: {
                            "n": a.n,
                            "failed_pairs": f,
                            "direct_p50": a.direct_p50,
                            "routed_p50": a.routed_p50,
                            "routed_p99": a.routed_p99,
                            "added_p50": a.added_p50,
                            "added_p99": a.added_p99,
                            "req_per_s": rates[c][k][0],
                            "failed_throughput": rates[c][k][1],
                            "cpu_s_per_request": cpu[c][k],
                        }
                        for k, (a, f) in r.items()
                    }
                    for c, r in results.items()
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
