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

Options ride on the endpoint as a query (``--kv-events 'tcp://127.0.0.1:5557?hash=
sha256_cbor&hash_seed=0&replay=tcp://127.0.0.1:5558'``, parsed by :func:`parse_options`):

* ``hash=sha256|sha256_cbor&hash_seed=S``: publish vLLM's block hashes
  (preheat/kvhash.py) instead of the engine's own, as a vLLM started with
  ``PYTHONHASHSEED=S --prefix-caching-hash-algo ...`` would, so a router configured for
  a real vLLM can be tested against this engine. The engine's cache keeps its own
  hashes; the publisher maps each stored block (and its parent) to the external chain.
* ``replay=tcp://...``: a ZMQ ROUTER socket answering vLLM's replay request (a DEALER
  sends ``[b"", start_seq (u64 big-endian)]``; the reply is ``[b"", seq, payload]`` for
  every buffered batch with ``seq >= start_seq``, then ``[b"", 0xff*8, b""]``), with
  vLLM's ``buffer_steps`` of 10,000 batches (option ``buffer_steps``). vLLM stops there: a subscriber whose start
  is older than the buffer gets what is left and must wait for a reset. This engine
  goes further (``snapshot``): when the buffer no longer reaches back to the start it
  first sends one batch, tagged with the last published sequence number, of
  ``["AllBlocksCleared"]`` and one ``BlockStored`` of every block it holds, so a late
  subscriber starts from the whole cache.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import msgpack
import zmq

from preheat.errors import ConfigError
from preheat.kvhash import HashScheme, make_scheme

__all__ = [
    "END_SEQ",
    "ExternalHashes",
    "KVEventPublisher",
    "KVEventsOptions",
    "batch_events",
    "parse_options",
]

MEDIUM = "GPU"
END_SEQ = b"\xff" * 8  # vLLM's end-of-replay marker (-1 as a signed u64)
BUFFER_STEPS = 10_000  # vLLM's default buffer_steps


@dataclass(frozen=True, slots=True)
class KVEventsOptions:
    """The engine's KV-events setting: bind ``endpoint``; the query options above."""

    endpoint: str
    replay: str | None = None
    hash: str = "builtin"
    hash_seed: str | None = None
    buffer_steps: int = BUFFER_STEPS


def parse_options(value: str) -> KVEventsOptions:
    """``tcp://host:port[?hash=...&hash_seed=...&replay=tcp://...]`` checked."""
    head, _, query = value.partition("?")
    q = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(q) - {"hash", "hash_seed", "replay", "buffer_steps"})
    if unknown:
        raise ConfigError(
            f"--kv-events {value!r}: unknown option(s) {', '.join(unknown)}; known: hash, "
            "hash_seed, replay, buffer_steps"
        )
    algo = q.get("hash", "builtin")
    make_scheme(algo, q.get("hash_seed"), where="--kv-events")
    replay = q.get("replay") or None
    if replay is not None and not replay.startswith(("tcp://", "ipc://")):
        raise ConfigError(
            f"--kv-events replay {replay!r} is not a ZMQ endpoint like tcp://127.0.0.1:5558"
        )
    steps = q.get("buffer_steps", str(BUFFER_STEPS))
    if not steps.isdigit() or not 1 <= int(steps) <= 1_000_000:
        raise ConfigError(f"--kv-events buffer_steps {steps!r} must be 1-1000000 (vLLM: 10000)")
    return KVEventsOptions(head, replay, algo, q.get("hash_seed"), int(steps))


class ExternalHashes:
    """The engine's block hashes -> the published ones (identity for ``builtin``)."""

    def __init__(self, scheme: HashScheme) -> None:
        self.scheme = scheme
        self._state: dict[int, tuple[Any, int]] = {}  # internal -> (chain state, external)

    @property
    def identity(self) -> bool:
        return self.scheme.name == "builtin"

    def stored(self, h: int, parent: int | None, block: Sequence[int], salt: str | None) -> int:
        if self.identity:
            return h
        up = self._state.get(parent) if parent is not None else None
        state = up[0] if up is not None else self.scheme.root(salt)
        st, ext = self.scheme.block(state, block, parent is None, salt)
        self._state[h] = (st, ext)
        return ext

    def external(self, h: int | None) -> int | None:
        if h is None or self.identity:
            return h
        got = self._state.get(h)
        return got[1] if got is not None else None

    def removed(self, h: int) -> int | None:
        if self.identity:
            return h
        got = self._state.pop(h, None)
        return got[1] if got is not None else None

    def clear(self) -> None:
        self._state.clear()


def batch_events(
    raw: Sequence[tuple[Any, ...]],
    tokens_of: Callable[[Hashable], Sequence[int] | None],
    block_size: int,
    external: ExternalHashes | None = None,
    salt_of: Callable[[Hashable], str | None] = lambda seq: None,
) -> list[list[Any]]:
    """vLLM event arrays from the cache's change log (``KVCache.events``); ``external``
    maps the engine's hashes to the published scheme's."""
    ext = external or ExternalHashes(HashScheme("builtin"))
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
            parent = ext.external(parent)
            h = ext.stored(h, ev[4], block, salt_of(seq))
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
            gone = ext.removed(ev[1])
            if gone is None:
                continue
            if out and out[-1][0] == "BlockRemoved":
                out[-1][1].append(gone)
            else:
                out.append(["BlockRemoved", [gone], MEDIUM])
        elif kind == "cleared":
            ext.clear()
            out.append(["AllBlocksCleared"])
    return out


class KVEventPublisher:
    """A ZMQ PUB socket bound to ``endpoint`` that sends event batches under ``topic``;
    with ``replay``, a ROUTER socket there that answers replay requests (``serve_replay``,
    called by the engine's loop)."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        *,
        replay: str | None = None,
        block_size: int = 16,
        buffer_steps: int = BUFFER_STEPS,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.block_size = block_size
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # What the published stream says the cache holds (for the snapshot).
        self.held: set[Any] = set()
        self.seq = 0
        self.replays = 0
        self.snapshots = 0

    def publish(self, events: list[list[Any]]) -> None:
        """Send one EventBatch (nothing for an empty list); never blocks."""
        if not events:
            return
        for ev in events:
            if ev[0] == "BlockStored":
                self.held.update(ev[1])
            elif ev[0] == "BlockRemoved":
                self.held.difference_update(ev[1])
            elif ev[0] == "AllBlocksCleared":
                self.held.clear()
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        # No room at the high-water mark: the message is dropped, the subscriber sees a gap.
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(
                [self.topic, self.seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
        if self._replay is not None:
            self._buffer.append((self.seq, payload))
        self.seq += 1

    def replay_waiting(self) -> bool:
        """A replay request is waiting on the replay socket."""
        return self._replay is not None and bool(self._replay.poll(0))

    def serve_replay(self) -> int:
        """Answer every waiting replay request (module header); the number answered."""
        sock = self._replay
        n = 0
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) not in (2, 3) or len(frames[-1]) != 8:
                continue  # not a replay request: ignored, as vLLM does
            ident, delim = frames[0], [b""] if len(frames) == 3 else []
            start = int.from_bytes(frames[-1], "big")
            oldest = self._buffer[0][0] if self._buffer else self.seq
            with contextlib.suppress(zmq.Again):
                if start < oldest and self.seq > 0:
                    self.snapshots += 1
                    last = self.seq - 1
                    snap: list[list[Any]] = [["AllBlocksCleared"]]
                    if self.held:
                        snap.append(
                            [
                                "BlockStored",
                                sorted(self.held),
                                None,
                                [],
                                self.block_size,
                                None,
                                MEDIUM,
                            ]
                        )
                    payload = msgpack.packb([time.time(), snap], use_bin_type=True)
                    sock.send_multipart(
                        [ident, *delim, last.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                    )
                    start = self.seq
                for seq, payload in self._buffer:
                    if seq >= start:
                        sock.send_multipart(
                            [ident, *delim, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                        )
                sock.send_multipart([ident, *delim, END_SEQ, b""], flags=zmq.NOBLOCK)
            self.replays += 1
            n += 1
        return n

    def close(self) -> None:
        self._sock.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()
