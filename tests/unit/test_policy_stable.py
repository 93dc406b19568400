"""The ``stable`` placement of prefix_aware (the default before ``stable-move``): agreement,
balance, spreads, churn."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.bench.workloads import WorkItem, chat, rag, templated
from preheat.router.policies import Instance, PolicyParams, PrefixAwarePolicy, RouteRequest
from preheat.router.policies.stable import HYSTERESIS, spread_for

SALT = b"0123456789abcdef-test-salt"


def _fleet(n: int) -> list[Instance]:
    return [Instance(f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def _replica(items: list[WorkItem], seed: int, *, placement: str = "stable") -> dict[str, str]:
    """One router replica: the stream in its own slightly shuffled arrival order (a chat
    turn still after its previous turn), with its own in-flight counts (8 open)."""
    rng = random.Random(seed)
    keys: dict[str, float] = {}
    for i, it in enumerate(items):
        k = i + rng.uniform(0, 1.3)
        if it.after is not None:
            k = max(k, keys[it.after] + rng.uniform(0.5, 1.3))
        keys[it.request_id] = k
    p = PrefixAwarePolicy(PolicyParams(placement=placement), salt=SALT)
    fleet = _fleet(7)
    open_: list[tuple[RouteRequest, object]] = []
    out = {}
    for it in sorted(items, key=lambda x: keys[x.request_id]):
        req = RouteRequest(it.request_id, body=it.body)
        c = p.choose(req, fleet)
        c.instance.in_flight += 1
        p.on_sent(req, c)
        open_.append((req, c))
        if len(open_) > 8:
            r, cc = open_.pop(rng.randrange(len(open_)))
            cc.instance.in_flight -= 1  # type: ignore[attr-defined]
            p.on_done(r, cc, ok=True, cached_tokens=None)  # type: ignore[arg-type]
        out[it.request_id] = c.instance.id
    return out


def _agreement(runs: list[dict[str, str]]) -> float:
    return sum(1 for k in runs[0] if len({r[k] for r in runs}) == 1) / len(runs[0])


def test_replicas_agree_when_they_see_the_stream_in_different_orders() -> None:
    """Four replicas, each with its own arrival order and in-flight counts, make the same
    choice for >= 95 % of RAG, templated and chat requests (this shuffle swaps more than
    the live benchmark's clients do; there 100 % of RAG and templated); the old default
    (learned) agrees on far fewer, and balance stays within 1.2 x the mean."""
    for items in (rag(400, documents=40, doc_chars=3000, seed=7), templated(400, seed=7)):
        runs = [_replica(items, s) for s in range(4)]
        assert _agreement(runs) >= 0.95, items[0].group
        shares = Counter(runs[0].values())
        assert max(shares.values()) <= 1.2 * len(items) / 7, shares
        learned = [_replica(items, s, placement="learned") for s in range(2)]
        assert _agreement(learned) < 0.9
    items = chat(400, seed=7)
    assert _agreement([_replica(items, s) for s in range(4)]) >= 0.95


def test_an_identical_stream_gives_identical_decisions() -> None:
    """Two replicas fed the same stream in the same order agree on every request."""
    items = rag(200, seed=3) + chat(200, seed=3)
    a, b = (
        PrefixAwarePolicy(PolicyParams(), salt=SALT),
        PrefixAwarePolicy(PolicyParams(), salt=SALT),
    )
    fa, fb = _fleet(5), _fleet(5)
    for it in items:
        req = RouteRequest(it.request_id, body=it.body)
        ca, cb = a.choose(req, fa), b.choose(req, fb)
        a.on_sent(req, ca)
        b.on_sent(req, cb)
        assert ca.instance.id == cb.instance.id and ca.outcome == cb.outcome != "spill"


def test_hot_documents_spread_cold_ones_stay_and_chat_turns_follow() -> None:
    """A hot document is served by several instances, a cold one by one; every turn of a
    conversation goes where its first turn went."""
    items = rag(800, documents=40, doc_chars=3000, seed=1)
    out = _replica(items, 0)
    groups: dict[str, set[str]] = {}
    for it in items:
        groups.setdefault(it.group, set()).add(out[it.request_id])
    sizes = Counter(it.group for it in items)
    hot, cold = sizes.most_common(1)[0][0], sizes.most_common()[-1][0]
    assert len(groups[hot]) >= 2
    assert len(groups[cold]) == 1
    items = chat(600, seed=3)
    out = _replica(items, 0)
    homes: dict[str, list[str]] = {}
    for it in items:
        homes.setdefault(it.group, []).append(out[it.request_id])
    stays = sum(h.count(h[0]) for h in homes.values())
    assert stays >= 0.97 * len(items)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 64),
    e=st.integers(0, 6),
    t=st.floats(0, 200, allow_nan=False),
)
def test_spread_moves_in_powers_of_two_with_hysteresis(n: int, e: int, t: float) -> None:
    """A spread is a power of two or the fleet size; it covers a target above it, and it
    shrinks only when the target with its hysteresis margin fits a smaller power."""
    k = min(2**e, n)
    k2 = spread_for(k, t, n)
    assert 1 <= k2 <= n
    assert k2 == n or k2 & (k2 - 1) == 0
    if t > k:
        assert k2 >= min(t, n) and k2 >= k
    elif k2 < k:
        assert t * (1 + HYSTERESIS) <= k2
    else:
        assert k2 == k


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.sampled_from([4, 7, 16]))
def test_churn_moves_only_the_prefixes_of_the_instance_that_changed(seed: int, n: int) -> None:
    """When one of n instances leaves, only its prefixes move (<= 1 % of the others);
    when one joins, at most 1.1/n of prefixes move."""
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
    p = PrefixAwarePolicy(PolicyParams(prefix_length=1024), salt=SALT)
    before = route(p, fleet)
    p.forget(fleet[-1].id)
    after = route(p, fleet[:-1])
    others = [d for d in before if before[d] != fleet[-1].id]
    assert sum(1 for d in others if after[d] != before[d]) <= 0.01 * len(others)
    q = PrefixAwarePolicy(PolicyParams(prefix_length=1024), salt=SALT)
    before = route(q, fleet[:-1])
    after = route(q, fleet)
    assert sum(1 for d in before if after[d] != before[d]) <= 1.1 / n * len(before)


def test_spill_only_at_the_concurrency_threshold() -> None:
    """Below concurrency_threshold the hashed member takes the request whatever its load;
    at the threshold the request spills, and with every instance full it falls back."""
    p = PrefixAwarePolicy(PolicyParams(concurrency_threshold=3), salt=SALT)
    fleet = _fleet(4)
    req = RouteRequest("r", text="a shared document " * 200)
    home = p.choose(req, fleet).instance
    home.in_flight = 2  # busier than every other, still below the threshold
    assert p.choose(req, fleet).instance is home
    home.in_flight = 3
    c = p.choose(req, fleet)
    assert c.outcome == "spill" and c.instance is not home
    for inst in fleet:
        inst.in_flight = 3
    assert p.choose(req, fleet).outcome == "fallback"


def test_capacity_weights_partition_cold_prefixes_by_kv_memory() -> None:
    """An instance whose engine reports twice the KV capacity gets about twice the cold
    prefixes."""
    p = PrefixAwarePolicy(PolicyParams(prefix_length=1024), salt=SALT)
    fleet = _fleet(3)
    p.set_capacity(fleet[0].id, 20_000)
    for inst in fleet[1:]:
        p.set_capacity(inst.id, 10_000)
    picks = Counter()
    for i in range(600):
        req = RouteRequest(f"r{i}", text=f"prefix {i} " + "x" * 1200)
        c = p.choose(req, fleet)
        picks[c.instance.id] += 1
    assert 1.6 <= picks[fleet[0].id] / (picks[fleet[1].id] + picks[fleet[2].id]) * 2 <= 2.4
