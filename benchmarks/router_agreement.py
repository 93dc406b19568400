"""Agreement of independent router replicas, and churn when an instance joins or leaves.

Agreement: 4 router processes (same salt, same 7 backends, no communication) each get
the same RAG request stream at the same concurrency, all at once; a request agrees when
all 4 sent it to the same backend. Backends are fast fakes that hold each request for
--service-ms, so in-flight counts (and the load bounds) are live. Peer routers are
measured the same way with the policy that does prefix_aware's job (like with like):
sglang-router and vllm-router ``cache_aware``, with their default retries.

Churn (in process, the same policy code): a policy routes every prefix of a stream,
then one of N instances is removed (or one added) and the stream is routed again; a
prefix is re-homed when its instance changed. Target: at most 1.1/N.

    .venv/bin/python benchmarks/router_agreement.py --requests 600

In process (``--in-process``, no router process): 4 copies of the policy code fed the
same stream, each in its own slightly perturbed order, in two models, over a list of
stream seeds (``--stream-seeds``):

* ``shuffle``: each replica sees request i at position ``i + U(0, 1.3)`` (a chat turn
  still after its previous turn), with its own in-flight counts, 8 open
  (tests/unit/test_policy_stable.py);
* ``closed``: 8 closed-loop clients per replica, answers after 20 ms plus the replica's
  own jitter, a chat turn sent only once its previous turn was answered, like the live
  concurrency-8 run (tests/unit/test_policy_stable_agreement.py).

Churn in process (``--churn-seeds``): the unit test's scenario (120 documents, 360
requests, N = 4, 7, 16): a case fails when more than 1 % of the other prefixes move
when one instance leaves, or more than 1.1/N when one joins.

    .venv/bin/python benchmarks/router_agreement.py --in-process --placements stable \
        --stream-seeds 7,1,2,3,4,5 --churn-seeds 12
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from preheat.bench.workloads import WORKLOADS, WorkItem, chat, rag, templated
from preheat.router.policies import Instance, PolicyParams, PrefixAwarePolicy, RouteRequest
from preheat.testing.routers import (
    RouterProcess,
    launch_router,
    start_fast_backend,
    start_peer_router,
)

SALT = b"agreement-benchmark-salt-0123456789"


async def feed(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, str]:
    """Send bodies in order (a chat turn only after its previous turn was answered);
    returns request id -> backend name that answered."""
    out: dict[str, str] = {}
    done = {b["rid"]: asyncio.Event() for b in bodies}
    it = iter(bodies)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker() -> None:
            for body in it:
                body = dict(body)
                path = body.pop("path")
                after = body.pop("after")
                if after:
                    await done[after].wait()
                async with s.post(url + path, json=body) as r:
                    doc = await r.json()
                    out[body["rid"]] = doc.get("backend", f"status {r.status}")
                done[body["rid"]].set()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def feed_all(
    urls: list[str], bodies: list[dict[str, Any]], concurrency: int
) -> list[dict[str, str]]:
    return list(await asyncio.gather(*(feed(u, bodies, concurrency) for u in urls)))


@contextlib.contextmanager
def replicas(kind: str, n: int, backends: list[str]) -> Iterator[list[RouterProcess]]:
    with contextlib.ExitStack() as stack:
        rs = []
        for _ in range(n):
            if kind.startswith("preheat"):
                placement = kind.partition("-")[2]
                r = launch_router(
                    backends=backends,
                    strategy="prefix_aware",
                    salt=SALT.decode(),
                    extra_args=["--placement", placement] if placement else [],
                )
                stack.callback(r.stop)
            else:
                peer, _, policy = kind.partition("-")
                r = stack.enter_context(
                    start_peer_router(peer, backends, policy=policy or "cache_aware")
                )
            rs.append(r)
        yield rs


def agreement(choices: list[dict[str, str]]) -> float:
    ids = set(choices[0])
    for c in choices[1:]:
        ids &= set(c)
    same = sum(1 for i in ids if len({c[i] for c in choices}) == 1)
    return same / max(len(ids), 1)


def max_share(choices: list[dict[str, str]], backends: int) -> float:
    """The busiest backend's share of the requests over the mean (averaged over replicas)."""
    ratios = []
    for c in choices:
        counts: dict[str, int] = {}
        for b in c.values():
            counts[b] = counts.get(b, 0) + 1
        ratios.append(max(counts.values()) * backends / max(len(c), 1))
    return sum(ratios) / len(ratios)


def churn(n: int, prefixes: int, seed: int) -> tuple[float, float]:
    """(share re-homed when one of n leaves, share re-homed when one joins)."""
    rng = random.Random(seed)
    texts = [
        f"doc {p} " + "".join(rng.choice("abcdefgh ") for _ in range(1500)) for p in range(prefixes)
    ]
    stream = [rng.randrange(prefixes) for _ in range(prefixes * 4)]

    def route(policy: PrefixAwarePolicy, fleet: list[Instance]) -> dict[int, str]:
        home: dict[int, str] = {}
        for i, p in enumerate(stream):
            req = RouteRequest(f"r{i}", text=texts[p] + f" q{i}")
            c = policy.choose(req, fleet)
            policy.on_sent(req, c)
            home[p] = c.instance.id
        return home

    fleet = [Instance(f"http://10.0.0.{i}:8000") for i in range(n)]
    pol = PrefixAwarePolicy(PolicyParams(prefix_length=1024), salt=SALT)
    before = route(pol, fleet)
    gone = fleet[-1]
    pol.forget(gone.id)
    after = route(pol, fleet[:-1])
    left = sum(1 for p in before if before[p] != after[p]) / len(before)

    pol2 = PrefixAwarePolicy(PolicyParams(prefix_length=1024), salt=SALT)
    before2 = route(pol2, fleet[:-1])
    after2 = route(pol2, fleet)
    joined = sum(1 for p in before2 if before2[p] != after2[p]) / len(before2)
    return left, joined


def _fleet(n: int) -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def shuffled_replica(items: list[WorkItem], seed: int, placement: str) -> dict[str, str]:
    """One replica of the ``shuffle`` model (module docstring): request id -> instance."""
    rng = random.Random(seed)
    keys: dict[str, float] = {}
    for i, it in enumerate(items):
        k = i + rng.uniform(0, 1.3)
        if it.after is not None:
            k = max(k, keys[it.after] + rng.uniform(0.5, 1.3))
        keys[it.request_id] = k
    p = PrefixAwarePolicy(PolicyParams(placement=placement), salt=SALT)
    fleet = _fleet(7)
    open_: list[tuple[RouteRequest, Any]] = []
    out = {}
    for it in sorted(items, key=lambda x: keys[x.request_id]):
        req = RouteRequest(it.request_id, body=it.body)
        c = p.choose(req, fleet)
        c.instance.in_flight += 1
        p.on_sent(req, c)
        open_.append((req, c))
        if len(open_) > 8:
            r, cc = open_.pop(rng.randrange(len(open_)))
            cc.instance.in_flight -= 1
            p.on_done(r, cc, ok=True, cached_tokens=None)
        out[it.request_id] = c.instance.id
    return out


def closed_replica(items: list[WorkItem], seed: int, placement: str) -> dict[str, str]:
    """One replica of the ``closed`` model (module docstring): request id -> instance."""
    rng = random.Random(seed)
    p = PrefixAwarePolicy(PolicyParams(placement=placement), salt=SALT)
    fleet = _fleet(7)
    done: set[str] = set()
    waiting: dict[str, list[int]] = {}
    heap: list[tuple[float, int, RouteRequest, Any]] = []
    out: dict[str, str] = {}
    nxt = iter(range(len(items)))

    def send(i: int, t: float) -> None:
        req = RouteRequest(items[i].request_id, body=items[i].body)
        c = p.choose(req, fleet)
        c.instance.in_flight += 1
        p.on_sent(req, c)
        out[req.request_id] = c.instance.id
        heapq.heappush(heap, (t + 0.020 + rng.expovariate(1 / 0.006), i, req, c))

    def take(t: float) -> None:
        for i in nxt:
            after = items[i].after
            if after is not None and after not in done:
                waiting.setdefault(after, []).append(i)
            else:
                send(i, t + rng.uniform(0, 0.001))
            return

    for _ in range(8):
        take(0.0)
    while heap:
        t, _, req, c = heapq.heappop(heap)
        c.instance.in_flight -= 1
        p.on_done(req, c, ok=True, cached_tokens=None)
        done.add(req.request_id)
        for w in waiting.pop(req.request_id, ()):
            send(w, t + rng.uniform(0, 0.002))
        take(t)
    return out


def in_process_agreement(
    placement: str, stream: str, seed: int, model: str, requests: int = 400
) -> tuple[float, float]:
    """(agreement of 4 in-process replicas, the first replica's max share over the
    mean) for one stream kind (rag, templated, chat) and stream seed."""
    if stream == "rag":
        items = rag(requests, documents=40, doc_chars=3000, seed=seed)
    elif stream == "templated":
        items = templated(requests, seed=seed)
    else:
        items = chat(requests, seed=seed)
    rep, base = (shuffled_replica, 0) if model == "shuffle" else (closed_replica, 20)
    runs = [rep(items, base + s, placement) for s in range(4)]
    same = sum(1 for k in runs[0] if len({r[k] for r in runs}) == 1) / len(runs[0])
    shares = Counter(runs[0].values())
    return same, max(shares.values()) * 7 / len(items)


def churn_case(placement: str, seed: int, n: int) -> tuple[float, float]:
    """The unit test's churn scenario: (share of the other prefixes moved when one of n
    leaves, share of prefixes moved when one joins)."""
    rng = random.Random(seed)
    texts = [f"doc {p} {rng.random()} " + "abcdefgh " * 150 for p in range(120)]
    stream = [rng.randrange(len(texts)) for _ in range(360)]

    def route(p: PrefixAwarePolicy, fleet: list[Instance]) -> dict[int, str]:
        home = {}
        for i, d in enumerate(stream):
            req = RouteRequest(f"r{i}", text=texts[d] + f" q{i}")
            c = p.choose(req, fleet)
            p.on_sent(req, c)
            home[d] = c.instance.id
        return home

    fleet = _fleet(n)
    params = PolicyParams(prefix_length=1024, placement=placement)
    p = PrefixAwarePolicy(params, salt=SALT)
    before = route(p, fleet)
    p.forget(fleet[-1].id)
    after = route(p, fleet[:-1])
    others = [d for d in before if before[d] != fleet[-1].id]
    left = sum(1 for d in others if after[d] != before[d]) / max(len(others), 1)
    q = PrefixAwarePolicy(params, salt=SALT)
    before = route(q, fleet[:-1])
    after = route(q, fleet)
    joined = sum(1 for d in before if after[d] != before[d]) / len(before)
    return left, joined


def in_process(args: argparse.Namespace, console: Console) -> None:
    seeds = [int(s) for s in args.stream_seeds.split(",") if s]
    for placement in [p for p in args.placements.split(",") if p]:
        table = Table(title=f"in process, placement {placement}: agreement (max share)")
        table.add_column("model / stream")
        for s in seeds:
            table.add_column(f"seed {s}", justify="right")
        table.add_column("min", justify="right")
        for model in ("shuffle", "closed"):
            for stream in ("rag", "templated", "chat"):
                cells = [in_process_agreement(placement, stream, s, model) for s in seeds]
                table.add_row(
                    f"{model} / {stream}",
                    *[f"{a:.3f} ({m:.2f})" for a, m in cells],
                    f"{min(a for a, _ in cells):.3f}",
                )
        console.print(table)
        fails = 0
        worst = (0.0, 0.0)
        for seed in range(args.churn_seeds):
            for n in (4, 7, 16):
                left, joined = churn_case(placement, seed, n)
                worst = (max(worst[0], left), max(worst[1], joined * n))
                fails += left > 0.01 or joined > 1.1 / n
        console.print(
            f"churn, {placement}: {fails} of {3 * args.churn_seeds} cases fail; worst "
            f"others moved when one leaves {worst[0]:.3f} (limit 0.01), worst moved "
            f"when one joins {worst[1]:.2f}/N (limit 1.1/N)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--backends", type=int, default=7)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--service-ms", type=float, default=20.0)
    ap.add_argument(
        "--peers",
        default="sglang-cache_aware,vllm-cache_aware",
        help="peer routers as PEER-POLICY ('' for none); cache_aware is prefix_aware's counterpart",
    )
    ap.add_argument(
        "--kinds",
        default="preheat,preheat-learned,preheat-hash,preheat-hybrid",
        help="preheat placements: preheat (the default, stable-move), preheat-stable, preheat-learned, "
        "preheat-hash, preheat-hybrid",
    )
    ap.add_argument(
        "--workload",
        default="rag",
        choices=sorted(WORKLOADS),
        help="rag: 40 documents of 3,000 chars; chat: multi-turn (a turn waits for the "
        "previous one); templated; unique",
    )
    ap.add_argument("--no-churn", action="store_true", help="skip the in-process churn part")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--in-process", action="store_true", help="in-process replica models only (docstring)"
    )
    ap.add_argument("--placements", default="stable", help="--in-process: placements")
    ap.add_argument("--stream-seeds", default="7,1,2,3,4,5", help="--in-process: stream seeds")
    ap.add_argument("--churn-seeds", type=int, default=12, help="--in-process: churn seeds")
    args = ap.parse_args()
    console = Console()
    console.print(f"loadavg at start: {Path('/proc/loadavg').read_text().strip()}")
    if args.in_process:
        in_process(args, console)
        return
    if args.workload == "rag":
        items = rag(args.requests, documents=40, doc_chars=3000, seed=7)
    else:
        items = WORKLOADS[args.workload](args.requests, seed=7)
    bodies = []
    for it in items:
        b = dict(it.body)
        b["model"] = "fake"
        b["rid"] = it.request_id
        b["path"] = it.path
        b["after"] = it.after
        b["preheat_test"] = {"hang_s": args.service_ms / 1000}
        bodies.append(b)
    results: dict[str, Any] = {"agreement": {}, "churn": {}}
    table = Table(
        title=f"{args.replicas} replicas, {args.requests} {args.workload} requests, "
        f"{args.backends} backends"
    )
    for col in ("router", "concurrency", "all replicas agree", "max share / mean"):
        table.add_column(col, justify="right")
    with contextlib.ExitStack() as stack:
        backends = [stack.enter_context(start_fast_backend()).url for _ in range(args.backends)]
        kinds = [k for k in args.kinds.split(",") if k]
        for kind in [*kinds, *[p for p in args.peers.split(",") if p]]:
            for conc in (int(c) for c in args.concurrency.split(",")):
                with replicas(kind, args.replicas, backends) as rs:
                    choices = asyncio.run(feed_all([r.url for r in rs], bodies, conc))
                a = agreement(choices)
                share = max_share(choices, args.backends)
                results["agreement"][f"{kind}/c{conc}"] = a
                results.setdefault("max_share", {})[f"{kind}/c{conc}"] = share
                table.add_row(kind, str(conc), f"{a:.1%}", f"{share:.2f}")
    console.print(table)
    t2 = Table(title="churn: share of prefixes re-homed (target <= 1.1/N)")
    for col in ("N", "one leaves", "one joins", "1/N", "1.1/N"):
        t2.add_column(col, justify="right")
    for n in () if args.no_churn else (4, 7, 16):
        left, joined = churn(n, 800, 3)
        results["churn"][n] = {"leave": left, "join": joined}
        t2.add_row(str(n), f"{left:.3f}", f"{joined:.3f}", f"{1 / n:.3f}", f"{1.1 / n:.3f}")
    console.print(t2)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
