"""Prefix-cache block hashes as engines compute them, for routers that must agree (pure).

A router that reads an engine's KV events (router/kvprecise.py) must hash a prompt's
token blocks exactly as that engine does, or no announced block ever matches. Schemes:

* ``builtin``: the simulated engine's (``kvcache.block_hashes``): each full block is
  ``hash((parent, tuple(tokens)))`` over ints, the chain starting at
  ``kvcache.root_hash(cache_salt)``; events carry that signed 64-bit int.
* ``sha256`` (vLLM v1's default ``--prefix-caching-hash-algo``) and ``sha256_cbor``:
  vLLM's ``hash_block_tokens``: ``digest = H((parent_digest, tuple(tokens),
  extra_keys))`` with ``H(x) = sha256(pickle.dumps(x, HIGHEST_PROTOCOL))`` or
  ``sha256(cbor2.dumps(x, canonical=True))``. The first block's parent is ``NONE_HASH =
  H(seed)``, ``seed`` being the engine's ``PYTHONHASHSEED`` string (without it vLLM
  draws 32 random bytes per process and no one else can reproduce its hashes).
  ``extra_keys`` is ``(cache_salt,)`` on the first block of a salted request and None
  otherwise (LoRA and multimodal keys are not modelled: such requests do not match).
  KV events carry ``int.from_bytes(digest, "big") & (2**64 - 1)`` by default
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the raw 32 bytes;
  :func:`external_hash` maps both to that int, the router's index key.

``sha256`` pickles with the router's Python: it equals vLLM's when both run CPython 3.8+
(pickle protocol 5 of ints, bytes and tuples is stable). ``sha256_cbor`` is the
portable choice. ``xxhash`` / ``xxhash_cbor`` are not supported (a clear error).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from preheat.errors import ConfigError
from preheat.kvcache import root_hash

__all__ = ["HASH_SCHEMES", "HashScheme", "external_hash", "make_scheme"]

HASH_SCHEMES = ("builtin", "sha256", "sha256_cbor")
_MASK64 = (1 << 64) - 1


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def external_hash(h: Any) -> int | None:
    """A block hash from a KV event as the index's int key (None: not a block hash)."""
    if type(h) is int:
        return h
    if isinstance(h, (bytes, bytearray)) and h:
        return int.from_bytes(h, "big") & _MASK64
    return None


@dataclass(frozen=True, slots=True)
class HashScheme:
    """One engine's block-hash chain: ``root`` starts it, ``block`` extends it."""

    name: str
    seed: str | None = None
    _fn: Callable[[Any], bytes] | None = field(default=None, repr=False, compare=False)
    _none: bytes = field(default=b"", repr=False, compare=False)

    def root(self, salt: str | None) -> Any:
        """The chain state before the first block (the salt is part of it for builtin)."""
        if self._fn is None:
            return root_hash(salt)
        return self._none

    def block(
        self, parent: Any, tokens: Sequence[int], first: bool, salt: str | None
    ) -> tuple[Any, int]:
        """The chain state after one full block, and the block's external (event) hash."""
        fn = self._fn
        if fn is None:
            h = hash((parent, tuple(tokens)))
            return h, h
        extra = (salt,) if first and salt else None
        d = fn((parent, tuple(tokens), extra))
        return d, int.from_bytes(d[-8:], "big")

    def hashes(self, tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
        """External hashes of every full block of ``tokens``."""
        state = self.root(salt)
        out = []
        for i in range(len(tokens) // block_size):
            state, ext = self.block(
                state, tokens[i * block_size : (i + 1) * block_size], i == 0, salt
            )
            out.append(ext)
        return out


def make_scheme(name: str, seed: str | int | None = None, *, where: str = "hash") -> HashScheme:
    """The scheme called ``name``; vLLM's need the engine's ``PYTHONHASHSEED`` as ``seed``."""
    if name == "builtin":
        return HashScheme("builtin")
    if name not in HASH_SCHEMES:
        raise ConfigError(
            f"{where}: hash {name!r} is not supported; use one of {', '.join(HASH_SCHEMES)} "
            "(vLLM: start it with --prefix-caching-hash-algo sha256 or sha256_cbor)"
        )
    if seed is None or str(seed) == "":
        raise ConfigError(
            f"{where}: hash {name} needs hash_seed, the engine's PYTHONHASHSEED: without it vLLM "
            "seeds its block hashes with random bytes; start vLLM with PYTHONHASHSEED=0 and "
            "give hash_seed: 0"
        )
    fn = _sha256_pickle if name == "sha256" else _sha256_cbor
    if name == "sha256_cbor":
        try:
            import cbor2  # noqa: F401
        except ImportError as exc:  # pragma: no cover - a declared dependency
            raise ConfigError(f"{where}: hash sha256_cbor needs the cbor2 package") from exc
    return HashScheme(name, str(seed), fn, fn(str(seed)))
