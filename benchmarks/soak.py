"""Soak: mixed traffic at a fixed rate through a real router and 4 simulated engines.

Not part of CI. One ``preheat router serve`` (prefix_aware) in front of 4
``preheat engine serve`` processes; an open-loop client sends RAG, multi-turn chat,
templated and unique requests (``preheat.bench.workloads.mixed``, a fresh seeded chunk
of documents and conversations every ``--chunk`` requests, so the router's prefix index
keeps meeting new prefixes) at ``--rate`` requests per second for ``--minutes``. Every
``--sample-s`` seconds (a minute) it records the requests that finished in the window
(ok, errors, e2e p50/p99, TTFT p99) and the resident memory of the router and of the
engines (``/proc/PID/status``). At the end it prints the table and the trend: the
least-squares slope of RSS per minute (first window left out: start-up) and the first
vs last window's p99. Bounded: at most ``--max-inflight`` requests in flight (beyond
that a request is shed and counted), and every process is stopped by PID at the end.

    .venv/bin/python benchmarks/soak.py --minutes 30 --rate 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from preheat.bench.routing import Outcome, send_one
from preheat.bench.soak import Window, rss_bytes, trend, window_stats
from preheat.bench.workloads import WorkItem, mixed
from preheat.testing.engines import simulated_engines
from preheat.testing.routers import launch_router

MIB = 1024 * 1024


class Recorder:
    """What finished since the last sample."""

    def __init__(self) -> None:
        self.sent = 0
        self.late = 0
        self.statuses: list[int] = []
        self.e2e: list[float] = []
        self.ttft: list[float] = []

    def done(self, o: Outcome) -> None:
        self.statuses.append(o.status)
        if o.status == 200:
            self.e2e.append(o.e2e_s)
            if o.ttft_s is not None:
                self.ttft.append(o.ttft_s)

    def take(
        self, minute: float, router_pid: int, engine_pids: list[int]
    ) -> tuple[Window, Recorder]:
        w = window_stats(
            minute,
            sent=self.sent,
            statuses=self.statuses,
            e2e_s=self.e2e,
            ttft_s=self.ttft,
            router_rss=rss_bytes(router_pid),
            engine_rss=[rss_bytes(p) for p in engine_pids],
            late=self.late,
        )
        return w, Recorder()


async def run(
    router_url: str,
    router_pid: int,
    engine_pids: list[int],
    args: argparse.Namespace,
    console: Console,
) -> list[Window]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    end = t0 + args.minutes * 60
    windows: list[Window] = []
    rec = Recorder()
    inflight: set[asyncio.Task[None]] = set()
    shed = 0
    timeout = aiohttp.ClientTimeout(total=60)
    conn = aiohttp.TCPConnector(limit=0)

    async def sampler() -> None:
        nonlocal rec
        next_at = t0 + args.sample_s
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            w, rec = rec.take((loop.time() - t0) / 60, router_pid, engine_pids)
            windows.append(w)
            console.print(_row_text(w), highlight=False)
            next_at += args.sample_s

    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def one(item: WorkItem, events: dict[str, asyncio.Event]) -> None:
            try:
                if item.after is not None:
                    await events[item.after].wait()
                o = await send_one(session, router_url, item, {})
                rec.done(o)
            finally:
                events[item.request_id].set()

        sampling = asyncio.create_task(sampler())
        i = 0
        chunk_no = 0
        next_chunk = asyncio.create_task(
            asyncio.to_thread(mixed, args.chunk, max_tokens=args.max_tokens, seed=args.seed)
        )
        try:
            while loop.time() < end:
                items = await next_chunk
                chunk_no += 1
                next_chunk = asyncio.create_task(
                    asyncio.to_thread(
                        mixed, args.chunk, max_tokens=args.max_tokens, seed=args.seed + chunk_no
                    )
                )
                events = {it.request_id: asyncio.Event() for it in items}
                for item in items:
                    due = t0 + i / args.rate
                    i += 1
                    now = loop.time()
                    if due > now:
                        await asyncio.sleep(due - now)
                    if loop.time() >= end:
                        break
                    if loop.time() - due > 1.0:
                        rec.late += 1
                    if len(inflight) >= args.max_inflight:
                        shed += 1
                        events[item.request_id].set()
                        continue
                    rec.sent += 1
                    task = asyncio.create_task(one(item, events))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
            if inflight:
                await asyncio.wait(set(inflight), timeout=60)
        finally:
            next_chunk.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await next_chunk
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
            for t in inflight:
                t.cancel()
    if rec.statuses or rec.sent:  # the last, partial window
        w, rec = rec.take((loop.time() - t0) / 60, router_pid, engine_pids)
        windows.append(w)
        console.print(_row_text(w) + " (partial)", highlight=False)
    if shed:
        console.print(f"shed {shed} requests (more than {args.max_inflight} in flight)")
    return windows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _mib(x: int | float | None) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def _row_text(w: Window) -> str:
    return (
        f"  min {w.minute:5.1f}: sent {w.sent}, ok {w.ok}, errors {w.errors}, "
        f"e2e p50 {_ms(w.e2e_p50_s)} ms p99 {_ms(w.e2e_p99_s)} ms, TTFT p99 "
        f"{_ms(w.ttft_p99_s)} ms, router {_mib(w.router_rss)} MiB, "
        f"engines {_mib(w.engines_rss)} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second")
    ap.add_argument("--sample-s", type=float, default=60.0, help="window length")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--profile", default="llama-3.1-70b-8xh100")
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--kv-blocks", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=400, help="requests per generated chunk")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-inflight", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (0 < args.minutes <= 120 and 0 < args.rate <= 500):
        raise SystemExit("--minutes must be in (0, 120] and --rate in (0, 500]")
    console = Console()
    load0 = Path("/proc/loadavg").read_text().strip()
    console.print(f"loadavg at start: {load0}")
    logdir = Path(tempfile.mkdtemp(prefix="preheat-soak-"))
    with simulated_engines(
        args.engines,
        profile=args.profile,
        time_scale=args.time_scale,
        kv_blocks=args.kv_blocks,
        model_name="m",
        log_dir=logdir,
    ) as engines:
        router = launch_router(
            backends=[e.url for e in engines],
            strategy="prefix_aware",
            log_path=logdir / "router.log",
        )
        try:
            windows = asyncio.run(
                run(router.url, router.pid, [e.pid for e in engines], args, console)
            )
        finally:
            router.stop()
    load1 = Path("/proc/loadavg").read_text().strip()
    table = Table(
        title=f"soak: {args.minutes:g} min at {args.rate:g} req/s, mixed traffic, "
        f"router + {args.engines} engines ({args.profile}, --time-scale {args.time_scale})"
    )
    cols = ("minute", "sent", "ok", "errors", "e2e p50 ms", "e2e p99 ms", "TTFT p99 ms")
    for col in (*cols, "router RSS MiB", "engines RSS MiB"):
        table.add_column(col, justify="right")
    for w in windows:
        table.add_row(
            f"{w.minute:.1f}",
            str(w.sent),
            str(w.ok),
            str(w.errors),
            _ms(w.e2e_p50_s),
            _ms(w.e2e_p99_s),
            _ms(w.ttft_p99_s),
            _mib(w.router_rss),
            _mib(w.engines_rss),
        )
    console.print(table)
    t = trend(windows)
    ratio = t.p99_ratio
    console.print(
        f"trend: router RSS {_mib(t.router_rss_per_min)} MiB/min, engines RSS "
        f"{_mib(t.engines_rss_per_min)} MiB/min (least squares, first window left out); "
        f"e2e p99 first {_ms(t.first_p99_s)} ms, last {_ms(t.last_p99_s)} ms"
        + (f" ({ratio:.2f}x)" if ratio is not None else "")
    )
    total = sum(w.sent for w in windows)
    errors = sum(w.errors for w in windows)
    console.print(f"requests sent {total}, errors {errors}; loadavg at end: {load1}")
    console.print(f"logs in {logdir}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "loadavg": [load0, load1],
                    "windows": [asdict(w) for w in windows],
                    "trend": asdict(t),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
