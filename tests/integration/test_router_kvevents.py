"""The router subscribes to its engines' KV events: a precise index that matches what the
engines announce, agreement between replicas, and fallback when a publisher dies (real
simulated engines, real router processes, ZMQ on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from preheat.kvcache import block_hashes
from preheat.router.kvprecise import PreciseIndex, prompt_tokens
from preheat.runtime.procs import free_port
from preheat.testing.engines import EngineProcess, start_simulated_engine
from preheat.testing.routers import RouterProcess, launch_router

TOKEN = "kv-admin-token"


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        return json.loads(resp.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class _Reference:
    """The test's own subscriber: every block each engine announced, applied in order."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}
        self.blocks: dict[str, set[int]] = {u: set() for u in endpoints}
        self.seqs: dict[str, list[int]] = {u: [] for u in endpoints}
        for url, ep in endpoints.items():
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(ep)
            self.socks[url] = s

    def drain(self, quiet_s: float = 0.5) -> None:
        for url, s in self.socks.items():
            while s.poll(int(quiet_s * 1000)):
                _, seq, payload = s.recv_multipart()
                self.seqs[url].append(int.from_bytes(seq, "big"))
                for ev in msgpack.unpackb(payload)[1]:
                    if ev[0] == "BlockStored":
                        self.blocks[url].update(ev[1])
                    elif ev[0] == "BlockRemoved":
                        self.blocks[url].difference_update(ev[1])
                    elif ev[0] == "AllBlocksCleared":
                        self.blocks[url].clear()

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
        self.ctx.term()


def _status(router: RouterProcess) -> dict[str, dict[str, Any]]:
    cfg = router.admin("GET", "/admin/config")
    return {
        i["url"]: i["kv_events_status"]
        for v in cfg["variants"]
        for i in v["instances"]
        if "kv_events_status" in i
    }


def _state_metric(router: RouterProcess, instance: str, state: str) -> float:
    text = _get(router.url + "/metrics")
    pat = (
        r'^preheat_router_kv_events_state\{instance="'
        + re.escape(instance)
        + r'",state="'
        + state
        + r'"\} (\S+)$'
    )
    m = re.search(pat, text, re.M)
    assert m, f"no kv_events_state series for {instance} {state}"
    return float(m.group(1))


def _decisions(router: RouterProcess) -> dict[str, float]:
    text = _get(router.url + "/metrics")
    pat = r'^preheat_router_decisions_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pat, text, re.M)}


@contextlib.contextmanager
def _fleet(
    tmp_path: Path,
) -> Iterator[tuple[list[EngineProcess], dict[str, str], list[RouterProcess]]]:
    """Two engines with KV events (60 blocks each), router A from a config file, router B
    (a replica) from --backend/--kv-events options."""
    engines: list[EngineProcess] = []
    routers: list[RouterProcess] = []
    try:
        eps = []
        for _ in range(2):
            ep = f"tcp://127.0.0.1:{free_port()}"
            eps.append(ep)
            engines.append(
                start_simulated_engine(
                    log_dir=tmp_path, kv_blocks=60, model_name="m", extra=["--kv-events", ep]
                )
            )
        endpoints = {e.url: ep for e, ep in zip(engines, eps, strict=True)}
        cfg = {
            "kv_events_silence_s": 2.0,
            "variants": [
                {
                    "name": "default",
                    "strategy": "prefix_aware",
                    "instances": [{"url": u, "kv_events": ep} for u, ep in endpoints.items()],
                }
            ],
        }
        path = tmp_path / "router.json"
        path.write_text(json.dumps(cfg))
        routers.append(launch_router(config=path, admin_token=TOKEN, log_path=tmp_path / "a.log"))
        extra = [a for u, ep in endpoints.items() for a in ("--kv-events", f"{u}={ep}")]
        routers.append(
            launch_router(
                backends=list(endpoints),
                strategy="prefix_aware",
                admin_token=TOKEN,
                extra_args=extra,
                log_path=tmp_path / "b.log",
            )
        )
        yield engines, endpoints, routers
    finally:
        for r in routers:
            r.stop()
        for e in engines:
            e.stop()


def _chat(doc: int, q: int) -> dict[str, Any]:
    system = f"document {doc}: " + " ".join(f"w{doc}x{i}" for i in range(200))
    return {
        "model": "m",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {q} about document {doc}?"},
        ],
    }


def test_precise_index_matches_the_engines_and_replicas_agree_then_a_dead_publisher_falls_back(
    tmp_path: Path,
) -> None:
    """Requests sharing 4 document prefixes through router A: both routers' precise
    indexes hold exactly the blocks each engine announced (the test's own subscriber),
    the same digests (replicas agree); a repeated document is served from cache on the
    engine whose blocks hold it; killing an engine turns its state to fallback in
    /metrics and /admin/config while the other stays synced."""
    with _fleet(tmp_path) as (engines, endpoints, (ra, rb)):
        ref = _Reference(endpoints)
        try:
            time.sleep(0.7)  # SUB sockets drop messages until their subscription lands
            for r in (ra, rb):
                assert set(_status(r)) == set(endpoints)
                assert all(s["state"] == "waiting" for s in _status(r).values())
            cached = []
            for q in range(3):
                for doc in range(4):
                    out = _post(ra.url + "/v1/chat/completions", _chat(doc, q))
                    cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            ref.drain()
            assert all(seqs == list(range(len(seqs))) and seqs for seqs in ref.seqs.values()), (
                ref.seqs
            )
            for r in (ra, rb):
                st = _wait(
                    lambda r=r: (
                        (
                            s
                            if all(
                                s[u]["state"] == "synced" and s[u]["last_seq"] == ref.seqs[u][-1]
                                for u in endpoints
                            )
                            else None
                        )
                        if (s := _status(r))
                        else None
                    ),
                    10,
                    "routers to apply every batch",
                )
                for u in endpoints:
                    assert st[u]["blocks"] == len(ref.blocks[u]) > 0
                    assert st[u]["gaps"] == 0
            sa, sb = _status(ra), _status(rb)
            for u in endpoints:
                assert sa[u]["digest"] == sb[u]["digest"]
            # Later questions on a document hit its cached prefix (>= the system prompt's
            # full blocks) on the engine whose announced blocks hold it.
            assert all(c >= 16 * 10 for c in cached[4:]), cached
            doc0 = block_hashes(prompt_tokens(_chat(0, 9)) or [], 16)[:10]
            holders = [u for u in endpoints if set(doc0) <= ref.blocks[u]]
            assert holders, "no engine announced document 0's blocks"
            # The holder empties its cache (AllBlocksCleared): the learned index still
            # names it, the precise one knows nobody holds document 0, so the next
            # question on it is placed as a cold prefix (outcome fallback, not affinity).
            req = urllib.request.Request(holders[0] + "/reset_prefix_cache", data=b"")
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
            _wait(lambda: _status(ra)[holders[0]]["blocks"] == 0, 10, "the reset to arrive")
            before = _decisions(ra)
            out = _post(ra.url + "/v1/chat/completions", _chat(0, 9))
            after = _decisions(ra)
            other = next(u for u in endpoints if u != holders[0])
            want = "affinity" if set(doc0) <= ref.blocks[other] else "fallback"
            assert after.get(want, 0) == before.get(want, 0) + 1, (want, before, after)
            assert sum(after.values()) == sum(before.values()) + 1
            if want == "affinity":
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

            engines[1].stop()
            dead = engines[1].url
            for r in (ra, rb):
                _wait(lambda r=r: _state_metric(r, dead, "fallback") == 1.0, 10, "fallback")
                assert _state_metric(r, engines[0].url, "synced") == 1.0
                st = _status(r)[dead]
                assert st["state"] == "fallback" and "disconnected" in st["reason"]
                assert st["blocks"] == 0
        finally:
            ref.close()


def test_gaps_and_joins_mid_stream_fall_back_until_all_blocks_cleared() -> None:
    """The index trusts a stream only from sequence 0 or AllBlocksCleared: joining at
    seq 5 or skipping 7 -> fallback (blocks dropped), AllBlocksCleared resyncs, and
    a restarted publisher (seq 0) starts empty and synced."""
    ix = PreciseIndex()
    ix.add("a")
    ix.apply("a", 5, [["BlockStored", [1, 2], None, [], 16, None, "GPU"]])
    assert ix.state("a") == "fallback" and ix.status()["a"]["blocks"] == 0
    ix.apply("a", 6, [["AllBlocksCleared"], ["BlockStored", [3], None, [], 16, None, "GPU"]])
    assert ix.state("a") == "synced" and ix.instances["a"].blocks == {3}
    ix.apply("a", 8, [["BlockStored", [4], 3, [], 16, None, "GPU"]])
    st = ix.status()["a"]
    assert st["state"] == "fallback" and st["gaps"] == 1 and st["blocks"] == 0
    assert "6 then 8" in st["reason"]
    ix.apply("a", 0, [["BlockStored", [9], None, [], 16, None, "GPU"]])
    assert ix.state("a") == "synced" and ix.instances["a"].blocks == {9}
    ix.apply("a", 1, [["BlockRemoved", [9], "GPU"]])
    assert ix.instances["a"].blocks == set()


@pytest.mark.parametrize("bad", ["udp://127.0.0.1:1", "tcp://127.0.0.1", "http://x:1"])
def test_a_bad_kv_events_endpoint_is_refused_with_the_fix(bad: str) -> None:
    """A kv_events value that is not tcp://host:port is a config error naming it."""
    from preheat.errors import ConfigError
    from preheat.router.config import parse_config

    with pytest.raises(ConfigError, match=r"tcp://127\.0\.0\.1:5557"):
        parse_config(
            {"variants": [{"name": "v", "instances": [{"url": "http://h:1", "kv_events": bad}]}]}
        )


def test_a_silent_publisher_falls_back_and_all_blocks_cleared_resyncs(tmp_path: Path) -> None:
    """A publisher (the test's PUB socket) that sends its first batch and then nothing:
    after a request whose blocks the engine would store, the router waits
    kv_events_silence_s (1 s) and falls back; AllBlocksCleared brings it back to synced."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ep)
    engine = start_simulated_engine(log_dir=tmp_path, model_name="m")
    router = None
    try:
        cfg = {
            "kv_events_silence_s": 1.0,
            "variants": [
                {
                    "name": "default",
                    "strategy": "prefix_aware",
                    "instances": [{"url": engine.url, "kv_events": ep}],
                }
            ],
        }
        path = tmp_path / "router.json"
        path.write_text(json.dumps(cfg))
        router = launch_router(config=path, admin_token=TOKEN, log_path=tmp_path / "r.log")

        def send(seq: int, events: list[Any]) -> None:
            pub.send_multipart(
                [b"kv@p@m", seq.to_bytes(8, "big"), msgpack.packb([time.time(), events])]
            )

        def state() -> str:
            return str(_status(router)[engine.url]["state"])

        # Resend seq 0 until the subscription has landed (a PUB drops until then).
        _wait(lambda: send(0, []) or state() == "synced", 10, "the first batch")
        assert _state_metric(router, engine.url, "synced") == 1.0
        _post(router.url + "/v1/completions", {"prompt": " word" * 200, "max_tokens": 1})
        _wait(lambda: state() == "fallback", 10, "the silence fallback")
        assert "no KV event" in _status(router)[engine.url]["reason"]
        assert _state_metric(router, engine.url, "fallback") == 1.0
        send(1, [["AllBlocksCleared"]])
        _wait(lambda: state() == "synced", 10, "AllBlocksCleared to resync")
    finally:
        if router is not None:
            router.stop()
        engine.stop()
        pub.close(0)
        ctx.term()
