"""A fleet of simulated engines behind the live routing policy, on virtual time (pure).

``simulate_routing(items, config, ...)`` routes each request with the router's own
``Policy`` (``router.policies.make_policy``: the same ``choose`` / ``on_sent`` /
``on_done`` calling convention and in-flight bookkeeping as ``router/proxy.py``) and
runs it on one of N ``SimEngine``s (``engine.core`` scheduler, ``kvcache``, ``timing``).

Arrivals (one pending arrival event at a time, so the heap stays small):

* **closed loop** (``concurrency``): that many clients send the requests in order, each
  the next one as soon as its previous answer is complete (``bench.routing.drive``); a
  request with ``after`` (a chat turn) waits for that request, holding its client.
* **open loop** (``rate``): Poisson arrivals at ``rate`` requests/s from the injected
  ``arrival_rng``; or each item's own ``t`` (a trace). A turn whose ``after`` has not
  finished is held until it has.

A request whose prompt the engine can never run (``PromptTooLong``) is routed, then
answered as an error (``ok=False``), as the live engine's 400 would be.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from preheat.errors import ConfigError, PromptTooLong
from preheat.router.policies import Instance, PolicyParams, RouteRequest, make_policy
from preheat.sim.engine import SimEngine
from preheat.sim.events import EventQueue
from preheat.sim.prompts import PromptBuilder
from preheat.telemetry.stats import percentile
from preheat.timing import EngineProfile

if TYPE_CHECKING:
    import random as _random

__all__ = ["RoutingConfig", "RoutingResult", "SimItem", "simulate_routing"]

_ARRIVAL = -1
# Prefix keys the policy's hasher remembers by string identity (router/prefix.py
# ``remember_parts``): more than the 4,096 families of the 1M-request run.
SHARED_PREFIX_KEYS = 8192


@dataclass(frozen=True, slots=True)
class SimItem:
    """One request: its id, endpoint path (``None``: inferred), OpenAI body, the request
    it must follow (a chat turn's previous turn), and a trace arrival time in seconds."""

    request_id: str
    path: str | None
    body: Mapping[str, Any]
    after: str | None = None
    t: float | None = None


@dataclass(frozen=True)
class RoutingConfig:
    """One routing simulation: fleet, engines, policy, arrival process."""

    instances: int
    profile: EngineProfile
    policy: str
    params: PolicyParams = field(default_factory=PolicyParams)
    kv_blocks: int | None = None
    """KV blocks per engine; default the profile's capacity."""
    concurrency: int | None = None
    rate: float | None = None
    """Poisson arrival rate in requests/s (open loop); else items' ``t`` or closed loop."""
    salt: bytes = b"preheat-sim-routing-salt"
    ids: tuple[str, ...] | None = None
    """Instance ids (the live router uses URLs); default ``sim-0`` ... ``sim-(N-1)``."""

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError(f"instances {self.instances} must be at least 1")
        if self.ids is not None and len(self.ids) != self.instances:
            raise ConfigError(f"{len(self.ids)} instance ids for {self.instances} instances")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"concurrency {self.concurrency} must be at least 1")
        if self.rate is not None and not self.rate > 0:
            raise ConfigError(f"rate {self.rate} must be a positive number of requests/s")
        if self.concurrency is not None and self.rate is not None:
            raise ConfigError("give either concurrency (closed loop) or rate (open loop)")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError(f"kv_blocks {self.kv_blocks} must be at least 1")


@dataclass(frozen=True)
class RoutingResult:
    """What a run measured (virtual time); ``summary()`` is the ``--json`` object."""

    config: RoutingConfig
    requests: int
    errors: int
    ttft_s: tuple[float, ...]
    e2e_s: tuple[float, ...]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    kv_queries: int
    kv_hits: int
    finished: tuple[int, ...]
    decisions: Mapping[str, int]
    preemptions: int
    virtual_s: float
    events: int
    steps: int

    def summary(self) -> dict[str, Any]:
        ids = self.config.ids or tuple(f"sim-{j}" for j in range(self.config.instances))
        total = sum(self.finished) or 1
        shares = {i: n / total for i, n in zip(ids, self.finished, strict=True)}
        mean = 1.0 / len(ids)

        def pct(xs: Sequence[float], q: float) -> float | None:
            return percentile(xs, q) * 1000.0 if xs else None

        vt = self.virtual_s
        return {
            "requests": self.requests,
            "errors": self.errors,
            "instances": self.config.instances,
            "profile": self.config.profile.name,
            "policy": self.config.policy,
            "placement": self.config.params.placement,
            "ttft_p50_ms": pct(self.ttft_s, 50),
            "ttft_p90_ms": pct(self.ttft_s, 90),
            "ttft_p99_ms": pct(self.ttft_s, 99),
            "e2e_p50_ms": pct(self.e2e_s, 50),
            "e2e_p90_ms": pct(self.e2e_s, 90),
            "output_tokens_per_s": self.output_tokens / vt if vt > 0 else 0.0,
            "requests_per_s": len(self.e2e_s) / vt if vt > 0 else 0.0,
            "kv_hit_rate": self.kv_hits / self.kv_queries if self.kv_queries else 0.0,
            "cached_prompt_share": self.cached_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
            "shares": shares,
            "max_share_over_mean": max(shares.values()) / mean,
            "decisions": dict(sorted(self.decisions.items())),
            "preemptions": self.preemptions,
            "virtual_s": vt,
            "events": self.events,
            "steps": self.steps,
        }


def simulate_routing(
    items: Sequence[SimItem],
    config: RoutingConfig,
    *,
    policy_rng: _random.Random,
    arrival_rng: _random.Random | None = None,
    builder: PromptBuilder | None = None,
) -> RoutingResult:
    """Run every item through the policy and the engines until the fleet is idle."""
    n_items = len(items)
    if n_items == 0:
        raise ConfigError("no requests to simulate; give a workload or a non-empty trace")
    closed = config.rate is None and (config.concurrency is not None or items[0].t is None)
    if closed and config.concurrency is None:
        raise ConfigError("requests without arrival times need a concurrency (closed loop)")
    if not closed and config.rate is None and any(it.t is None for it in items):
        raise ConfigError("a trace with arrival times needs 't' on every line")
    if config.rate is not None and arrival_rng is None:
        raise ConfigError("an open-loop rate needs an arrival random source")
    profile = config.profile
    n = config.instances
    ids = config.ids or tuple(f"sim-{j}" for j in range(n))
    policy = make_policy(config.policy, config.params, salt=config.salt, rng=policy_rng)
    hasher = getattr(policy, "hasher", None)
    if hasher is not None:  # the items hold every prompt anyway: reuse shared prefixes' keys
        hasher.remember_parts(SHARED_PREFIX_KEYS)
    engines = [SimEngine(j, profile, kv_blocks=config.kv_blocks) for j in range(n)]
    instances = [Instance(x) for x in ids]
    index = {x: j for j, x in enumerate(ids)}
    builder = builder or PromptBuilder(profile.block_size)
    q = EventQueue()
    at = q.at

    arrival = [0.0] * n_items
    ttft: list[float] = []
    e2e: list[float] = []
    flight: dict[int, tuple[RouteRequest, Any, Instance]] = {}
    decisions: Counter[str] = Counter()
    finished = [0] * n
    done_ids: set[str] = set()
    waiters: dict[str, list[int]] = {}
    stats = {"errors": 0, "out": 0, "prompt": 0, "cached": 0}
    nxt = 0
    # Sends that a finished (or refused) request released, run in order by ``drain``: a
    # refused request releases the next one at once, so a loop, not a recursion.
    work: deque[tuple[Callable[[int, float], None], int]] = deque()
    draining = False

    def send(i: int, now: float) -> None:
        it = items[i]
        arrival[i] = now
        rr = RouteRequest(it.request_id, body=it.body)
        choice = policy.choose(rr, instances)
        decisions[choice.outcome] += 1
        inst = choice.instance
        inst.in_flight += 1
        policy.on_sent(rr, choice)
        p = builder.build(it.path, it.body)
        j = index[inst.id]
        try:
            end = engines[j].submit(i, p.tokens, p.hashes, p.max_tokens, now, salt=p.salt)
        except PromptTooLong:
            inst.in_flight -= 1
            policy.on_done(rr, choice, ok=False, cached_tokens=None)
            stats["errors"] += 1
            release(it.request_id, now)
            return
        flight[i] = (rr, choice, inst)
        if end is not None:
            at(end, j)

    def ready(i: int, now: float) -> None:
        after = items[i].after
        if after is not None and after not in done_ids:
            waiters.setdefault(after, []).append(i)
        else:
            send(i, now)

    def release(request_id: str, now: float) -> None:
        nonlocal nxt, draining
        done_ids.add(request_id)
        for w in waiters.pop(request_id, ()):
            work.append((send, w))
        if closed and nxt < n_items:
            nxt += 1
            work.append((ready, nxt - 1))
        if draining:
            return
        draining = True
        while work:
            fn, i = work.popleft()
            fn(i, now)
        draining = False

    def arrive_next(now: float) -> None:
        if nxt >= n_items:
            return
        if config.rate is not None:
            assert arrival_rng is not None
            at(now + arrival_rng.expovariate(config.rate), _ARRIVAL)
        else:
            t = items[nxt].t
            assert t is not None
            at(max(t, now), _ARRIVAL)

    if closed:
        assert config.concurrency is not None
        for _ in range(config.concurrency):
            if nxt >= n_items:  # (refused requests release their client at once)
                break
            nxt += 1
            ready(nxt - 1, 0.0)
    else:
        arrive_next(0.0)

    pop = q.pop
    while q:
        t, kind, _ = pop()
        if kind == _ARRIVAL:
            nxt += 1
            ready(nxt - 1, t)
            arrive_next(t)
            continue
        j = int(kind)  # type: ignore[call-overload]
        eng = engines[j]
        outs = eng.finish_step(t)
        end = eng.plan(t)
        if end is not None:
            at(end, j)
        for o in outs:
            i = o.req_id
            if o.first:
                ttft.append(t - arrival[i])
            if o.finished:
                rr, choice, inst = flight.pop(i)
                inst.in_flight -= 1
                policy.on_done(rr, choice, ok=True, cached_tokens=o.num_cached_tokens)
                finished[j] += 1
                e2e.append(t - arrival[i])
                stats["out"] += o.num_output_tokens
                stats["prompt"] += o.num_prompt_tokens
                stats["cached"] += o.num_cached_tokens
                release(rr.request_id, t)

    if flight or nxt < n_items or waiters:
        raise RuntimeError(
            f"simulation ended with {len(flight)} requests in flight, {n_items - nxt} unsent "
            f"and {sum(map(len, waiters.values()))} waiting on a request that never ran"
        )
    start = min(arrival) if arrival else 0.0
    return RoutingResult(
        config=config,
        requests=n_items,
        errors=stats["errors"],
        ttft_s=tuple(ttft),
        e2e_s=tuple(e2e),
        output_tokens=stats["out"],
        prompt_tokens=stats["prompt"],
        cached_tokens=stats["cached"],
        kv_queries=sum(e.sched.kv.queries for e in engines),
        kv_hits=sum(e.sched.kv.hits for e in engines),
        finished=tuple(finished),
        decisions=dict(decisions),
        preemptions=sum(e.sched.num_preemptions for e in engines),
        virtual_s=q.now - start,
        events=q.popped,
        steps=sum(e.sched.steps for e in engines),
    )
