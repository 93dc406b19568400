"""The simulated engine publishes KV-cache events in vLLM's exact wire format (a real
engine process and a real ZMQ subscriber on 127.0.0.1)."""

from __future__ import annotations

import json
import time
import urllib.request

import msgpack
import zmq

from preheat.engine.core.tokenizer import Tokenizer
from preheat.kvcache import block_hashes
from preheat.runtime.procs import free_port
from preheat.testing.engines import simulated_engines


def _post(url: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read()


def _recv(sock: zmq.Socket, timeout_s: float = 10.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no KV event message arrived"
    return sock.recv_multipart()


def test_block_stored_and_cleared_events_match_vllms_format_and_the_engines_hashes() -> None:
    """A completion of 100 prompt tokens produces BlockStored with the engine's chained
    hashes of its 6 full blocks (and their token ids) under topic kv@<pod>@<model>, seq 0
    as a big-endian uint64; a prefix-cache reset produces AllBlocksCleared with seq 1."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    extra = ["--kv-events", endpoint, "--kv-events-pod", "pod-a"]
    with simulated_engines(1, model_name="m", extra=extra) as engines:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sock.connect(endpoint)
        try:
            time.sleep(0.5)  # a PUB socket drops messages until the subscription lands
            tokens = list(range(5000, 5100))
            _post(engines[0].url + "/v1/completions", {"prompt": tokens, "max_tokens": 2})
            topic, seq, payload = _recv(sock)
            assert topic == b"kv@pod-a@m"
            assert len(seq) == 8 and int.from_bytes(seq, "big") == 0
            ts, events = msgpack.unpackb(payload)[:2]
            assert abs(ts - time.time()) < 60
            stored = [e for e in events if e[0] == "BlockStored"]
            hashes = [h for e in stored for h in e[1]]
            assert hashes[:6] == block_hashes(tokens, 16)
            first = stored[0]
            assert first[2] is None and first[4] == 16 and first[5] is None and first[6] == "GPU"
            assert first[3][:96] == tokens[:96]
            _post(engines[0].url + "/reset_prefix_cache")
            topic, seq, payload = _recv(sock)
            assert int.from_bytes(seq, "big") == 1
            assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
        finally:
            sock.close(0)
            ctx.term()


def test_an_evicted_block_is_announced_as_block_removed() -> None:
    """With 20 KV blocks, a second 240-token prompt evicts the first's blocks: the
    engine publishes BlockRemoved with exactly hashes it stored before, seq numbers
    without gaps."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    extra = ["--kv-events", endpoint]
    with simulated_engines(1, model_name="m", kv_blocks=20, extra=extra) as engines:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        try:
            time.sleep(0.5)
            text = Tokenizer().encode
            a = text(" alpha" * 240)
            b = text(" beta" * 240)
            stored: set[int] = set()
            removed: list[int] = []
            seqs = []
            for prompt in (a, b):
                _post(engines[0].url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            deadline = time.monotonic() + 10
            while not removed and time.monotonic() < deadline:
                _, seq, payload = _recv(sock)
                seqs.append(int.from_bytes(seq, "big"))
                for e in msgpack.unpackb(payload)[1]:
                    if e[0] == "BlockStored":
                        stored.update(e[1])
                    elif e[0] == "BlockRemoved":
                        removed.extend(e[1])
            assert removed and set(removed) <= stored
            assert set(removed) <= set(block_hashes(a, 16))
            assert seqs == list(range(len(seqs)))
        finally:
            sock.close(0)
            ctx.term()
