"""KV events for real models and late joins, against real simulated engines over ZMQ:
the router's block hashes of a prompt (a real tokenizer.json, vLLM's sha256_cbor) equal
the ones the engine announces, and a router started after its engines gets in sync by
replay (history or snapshot), or stays on the learned index when the replay cannot."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq
from tokenizers import Tokenizer

from preheat.engine.kvevents import END_SEQ
from preheat.kvhash import make_scheme
from preheat.router.kvevents_sub import KVEventSubscriber
from preheat.router.kvprecise import PreciseIndex
from preheat.runtime.procs import free_port
from preheat.testing.engines import start_simulated_engine
from preheat.testing.hftokenizer import build_snapshot

DOC = "the engines publish which blocks they store and which they evict; " * 30


def _complete(url: str, prompt: Any, max_tokens: int = 4) -> dict[str, Any]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=20) as resp:
        return json.loads(resp.read())


async def _until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_router_hashes_of_a_real_tokenizer_prompt_equal_the_engines(tmp_path: Path) -> None:
    """An engine publishing vLLM's sha256_cbor hashes (PYTHONHASHSEED 0) is given the
    token ids a vLLM would compute for a chat request (the real tokenizer.json and chat
    template); the router, configured with that tokenizer and hash, finds every full
    block of the same chat body announced by that engine."""
    snap = build_snapshot(tmp_path / "model")
    ep = f"tcp://127.0.0.1:{free_port()}"
    eng = start_simulated_engine(
        log_dir=tmp_path,
        model_name="m",
        extra=["--kv-events", f"{ep}?hash=sha256_cbor&hash_seed=0"],
    )
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "answer"}, {"role": "user", "content": DOC}],
    }
    setting = f"{ep}?tokenizer={snap}&hash=sha256_cbor&hash_seed=0"

    async def main() -> None:
        ix = PreciseIndex()
        sub = KVEventSubscriber(ix)
        sub.configure({eng.url: setting}, 5.0)
        await sub.start()
        try:
            await asyncio.sleep(0.5)  # the SUB connects before the first batch
            tok = Tokenizer.from_file(str(snap / "tokenizer.json"))
            text = ix.instances[eng.url].prompt.codec.render(body["messages"])  # type: ignore[attr-defined]
            ids = tok.encode(text, add_special_tokens=False).ids
            await asyncio.to_thread(_complete, eng.url, ids)
            want = make_scheme("sha256_cbor", 0).hashes(ids, 16)
            await _until(
                lambda: ix.state(eng.url) == "synced" and set(want) <= ix.instances[eng.url].blocks,
                10,
                "blocks",
            )
            lk = ix.lookup(body, [eng.url])
            assert lk is not None and lk.hashes == tuple(want) and lk.held[eng.url] == len(want)
            assert ix.status()[eng.url]["hash"] == "sha256_cbor"
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        eng.stop()


def test_a_late_router_syncs_by_replay_of_history_or_of_a_snapshot(tmp_path: Path) -> None:
    """Two engines serve requests before any router subscribes: one still holds its whole
    history in the replay buffer (vLLM's behaviour), the other (buffer_steps 1) answers
    with a snapshot. A router that joins at the next batch is synced with both, holding
    exactly the blocks a subscriber present from the start holds."""
    engines, settings, refs = [], {}, {}
    ctx = zmq.Context()
    try:
        for steps in (10000, 1):
            ep, rp = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
            e = start_simulated_engine(
                log_dir=tmp_path,
                model_name="m",
                kv_blocks=64,
                extra=["--kv-events", f"{ep}?replay={rp}&buffer_steps={steps}"],
            )
            engines.append(e)
            settings[e.url] = f"{ep}?replay={rp}"
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            refs[e.url] = s
        time.sleep(0.5)
        for k in range(6):  # 64 blocks: later prompts evict earlier ones
            for e in engines:
                _complete(e.url, f"request {k}: " + DOC[: 600 + 50 * k])
        ref_blocks: dict[str, set[int]] = {}
        for url, s in refs.items():
            blocks: set[int] = set()
            while s.poll(500):
                _, _, payload = s.recv_multipart()
                for ev in msgpack.unpackb(payload)[1]:
                    if ev[0] == "BlockStored":
                        blocks.update(ev[1])
                    elif ev[0] == "BlockRemoved":
                        blocks.difference_update(ev[1])
            ref_blocks[url] = blocks
            assert blocks

        async def main() -> None:
            ix = PreciseIndex()
            sub = KVEventSubscriber(ix)
            sub.configure(settings, 5.0)
            await sub.start()
            try:
                await asyncio.sleep(0.5)
                for e in engines:  # the next batch: the router joins mid-stream
                    await asyncio.to_thread(_complete, e.url, "one more: " + DOC[:400])
                await _until(
                    lambda: all(ix.state(e.url) == "synced" for e in engines), 10, "replay"
                )
                await asyncio.sleep(0.5)
                for e in engines:
                    s = refs[e.url]
                    while s.poll(300):
                        _, _, payload = s.recv_multipart()
                        for ev in msgpack.unpackb(payload)[1]:
                            if ev[0] == "BlockStored":
                                ref_blocks[e.url].update(ev[1])
                            elif ev[0] == "BlockRemoved":
                                ref_blocks[e.url].difference_update(ev[1])
                    assert ix.instances[e.url].blocks == ref_blocks[e.url]
                st = ix.status()
                assert st[engines[0].url]["reason"] == "first batch of the publisher"
                assert st[engines[1].url]["reason"] == "AllBlocksCleared"  # the snapshot
                assert sub.replays == 2
            finally:
                await sub.stop()

        asyncio.run(main())
    finally:
        for s in refs.values():
            s.close(0)
        ctx.term()
        for e in engines:
            e.stop()


def test_a_replay_that_does_not_reach_back_leaves_the_instance_on_the_learned_index() -> None:
    """A vLLM-style publisher whose buffer starts at sequence 5 (the test's own PUB and
    ROUTER sockets): the router replays 5..6, cannot trust it, and stays in fallback."""
    ep, rp = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    ctx = zmq.Context()
    pub, rtr = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for s in (pub, rtr):
        s.setsockopt(zmq.LINGER, 0)
    pub.bind(ep)
    rtr.bind(rp)
    batch = msgpack.packb([0.0, [["BlockStored", [11, 12], None, [], 16, None, "GPU"]]])

    async def main() -> None:
        ix = PreciseIndex()
        sub = KVEventSubscriber(ix)
        sub.configure({"http://127.0.0.1:1": f"{ep}?replay={rp}"}, 5.0)
        await sub.start()
        try:
            await asyncio.sleep(0.5)
            pub.send_multipart([b"kv@p@m", (7).to_bytes(8, "big"), batch])
            deadline = time.monotonic() + 10
            while not rtr.poll(0):
                assert time.monotonic() < deadline, "no replay request"
                await asyncio.sleep(0.05)
            ident, _, start = rtr.recv_multipart()
            assert int.from_bytes(start, "big") == 0
            for seq in (5, 6):
                rtr.send_multipart([ident, b"", seq.to_bytes(8, "big"), batch])
            rtr.send_multipart([ident, b"", END_SEQ, b""])
            await _until(lambda: sub.replays == 1, 10, "the replay")
            await asyncio.sleep(0.2)
            st = ix.status()["http://127.0.0.1:1"]
            assert st["state"] == "fallback" and st["blocks"] == 0
        finally:
            await sub.stop()

    try:
        asyncio.run(main())
    finally:
        pub.close(0)
        rtr.close(0)
        ctx.term()
