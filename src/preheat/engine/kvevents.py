"""KV-cache events of the simulated engine, published exactly as vLLM publishes them.

With ``preheat engine serve --kv-events tcp://127.0.0.1:P`` the engine binds a ZMQ PUB
socket there and, after each scheduling step that changed its prefix cache, sends one
message of three frames (vLLM ``ZmqEventPublisher``):

1. the topic ``kv@<pod>@<model>`` (``pod``: ``--kv-events-pod``, default host:port),
2. the sequence number, a uint64 big-endian, 0, 1, 2, ... per publisher,
3. a msgpack ``EventBatch`` ``[ts, events]``, each event an array tagged by its kind:
   ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
   medium]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.

Block hashes are the engine's own chained hashes (``kvcache.block_hashes``: a 64-bit
signed int per full block of 16 tokens); ``token_ids`` are the tokens of the stored
blocks, in order; consecutive stored blocks of one sequence form one ``BlockStored``
whose parent is the block before the first. ``medium`` is ``"GPU"``, ``lora_id`` null.
A PUB socket never blocks the engine: a subscriber that is too slow loses messages and
sees a gap in the sequence numbers (it must then stop trusting its index).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import msgpack
import zmq

__all__ = ["KVEventPublisher", "batch_events"]

MEDIUM = "GPU"


def batch_events(
    raw: Sequence[tuple[Any, ...]],
    tokens_of: Callable[[Hashable], Sequence[int] | None],
    block_size: int,
) -> list[list[Any]]:
    """vLLM event arrays from the cache's change log (``KVCache.events``)."""
    out: list[list[Any]] = []
    cur: list[Any] | None = None  # the open BlockStored
    cur_seq: Any = None
    cur_next = -1
    for ev in raw:
        kind = ev[0]
        if kind == "stored":
            _, seq, i, h, parent = ev
            toks = tokens_of(seq)
            block = list(toks[i * block_size : (i + 1) * block_size]) if toks is not None else []
            if cur is not None and seq == cur_seq and i == cur_next:
                cur[1].append(h)
                cur[3].extend(block)
            else:
                cur = ["BlockStored", [h], parent, block, block_size, None, MEDIUM]
                out.append(cur)
                cur_seq = seq
            cur_next = i + 1
            continue
        cur = None
        if kind == "removed":
            if out and out[-1][0] == "BlockRemoved":
                out[-1][1].append(ev[1])
            else:
                out.append(["BlockRemoved", [ev[1]], MEDIUM])
        elif kind == "cleared":
            out.append(["AllBlocksCleared"])
    return out


class KVEventPublisher:
    """A ZMQ PUB socket bound to ``endpoint`` that sends event batches under ``topic``."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.seq = 0

    def publish(self, events: list[list[Any]]) -> None:
        """Send one EventBatch (nothing for an empty list); never blocks."""
        if not events:
            return
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        # No room at the high-water mark: the message is dropped, the subscriber sees a gap.
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(
                [self.topic, self.seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
        self.seq += 1

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
