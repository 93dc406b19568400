"""Prefix keys: canonical prompt text, keyed chained block hashes, rendezvous scores (pure).

The router never keeps prompt text. A request becomes

* its **canonical text** (router/prefix_text.py): what the engine would see at the front
  of its prompt, in order: the fields that change the rendered prompt (tools, chat
  template, documents), then the role-tagged messages (or the completion prompt). Only
  the first ``prefix_length`` characters count (SageMaker's ``PrefixLength``).
* a **chain** of 64-bit block hashes: the text is cut into blocks of ``block_chars``
  characters and block *i*'s hash is a keyed hash of *all text up to the end of block i*
  (so equal hashes mean equal prefixes, exactly like the engine's chained KV block
  hashes). The key is a per-deployment secret ``salt``: without it nobody can test a guess
  of a prompt against a logged or exported hash.
* a **rendezvous score** per instance: ``score(key, seed(instance))``. Every router
  replica with the same salt and the same instance list ranks instances identically,
  and removing one of N instances re-ranks only the keys it ranked first (about 1/N).

Cost (measured in benchmarks/router_decision.py): the chain is one incremental SHA-256
pass over the text (SHA-NI makes it ~1.7 GB/s, 1.8x BLAKE2b in CPython on the same CPU)
plus one ``digest()`` per block (~0.35 us; it finalises a copy of the state); a
32,000-character prefix with 2,048-character blocks is 16 digests. ``canonical_parts``
hands the body's own strings to ``chain_parts``, so a long message is neither copied
into a joined text nor encoded past ``prefix_length``. The model name and ``cache_salt`` seed the chain, so different models or
tenants never share keys (vLLM's cache_salt isolates their KV too).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from preheat.errors import ConfigError
from preheat.router.prefix_text import _SEP, canonical, canonical_parts, canonical_text

__all__ = [
    "CHARS_PER_TOKEN",
    "DEFAULT_BLOCK_CHARS",
    "MASK64",
    "MAX_PREFIX_LENGTH",
    "MIN_CUT",
    "MIN_PREFIX_LENGTH",
    "SCORE_MULTIPLIER",
    "PrefixHasher",
    "PrefixKey",
    "canonical",
    "canonical_parts",
    "canonical_text",
    "check_prefix_length",
    "rank",
    "score",
]

MASK64 = (1 << 64) - 1
# The first 8 digest bytes as a little-endian integer (int.from_bytes(d[:8], "little")).
_u64 = struct.Struct("<Q").unpack_from
MIN_PREFIX_LENGTH = 1024
MAX_PREFIX_LENGTH = 65536
DEFAULT_BLOCK_CHARS = 2048
# A message end closes a block only if the block is at least this long, so a chat of
# many short messages does not cost one digest per message.
MIN_CUT = 256
# Rough characters per token, used only to *predict* cached tokens for the decision log.
CHARS_PER_TOKEN = 4

# key -> (the parts it names, the chain, the cuts)
_Memo = dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]]


class PrefixKey(NamedTuple):
    """The hashed form of one request's prompt prefix; no text.

    ``chain[i]`` identifies the text up to the end of block ``i``; ``chain[-1]`` is the
    request's key. ``prefix_chars`` is how many characters were hashed (at most
    ``prefix_length``), ``prompt_chars`` the length of the whole canonical prompt,
    ``cuts[i]`` where block ``i`` ends. Immutable (a NamedTuple: one per request).
    """

    chain: tuple[int, ...]
    prefix_chars: int
    prompt_chars: int
    hinted: bool = False
    cuts: tuple[int, ...] = ()

    @property
    def key(self) -> int:
        return self.chain[-1]


def check_prefix_length(value: int, *, where: str = "prefix_length") -> int:
    """Validate a prefix length (characters, 1,024-65,536 as SageMaker's PrefixLength)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} {value!r} is not an integer; give characters like 8192")
    if not MIN_PREFIX_LENGTH <= value <= MAX_PREFIX_LENGTH:
        raise ConfigError(
            f"{where} {value} is outside {MIN_PREFIX_LENGTH}-{MAX_PREFIX_LENGTH} characters; "
            "cover the shared part of the prompt plus some unique text, e.g. 8192"
        )
    return value


# Keys and seeds are already uniform 64-bit keyed-hash outputs, so one odd multiply of
# their XOR (a Knuth multiplicative hash; the high bits decide the order) is enough: it
# keeps the 64-instance scoring loop at a few microseconds.
SCORE_MULTIPLIER = 0x9E3779B97F4A7C15


def score(key: int, seed: int) -> int:
    """Rendezvous (highest-random-weight) score of an instance ``seed`` for a ``key``."""
    return ((key ^ seed) * SCORE_MULTIPLIER) & MASK64


def _covering(parts: Sequence[str], n: int) -> tuple[int, int]:
    """How many leading parts hold the first ``n`` characters of ``"".join(parts)``, and
    the length of those parts but the last (where the last one starts)."""
    size = 0
    k = 0
    for k, part in enumerate(parts, 1):
        m = size + len(part)
        if m >= n:
            return k, size
        size = m
    return k, size


def _bytes(text: str) -> bytes:
    # ASCII text as it is (on PyPy a str's bytes are already UTF-8: no copy).
    return text.encode("ascii") if text.isascii() else text.encode("utf-8", "surrogatepass")


def _digests(h: Any, parts: Sequence[str], cuts: Sequence[int]) -> list[int]:
    """Feed ``"".join(parts)`` to ``h`` up to each of ``cuts`` (absolute, ascending; the
    last at most the joined length) and read each block's hash, part by part: a part
    inside a block is fed whole, only a part that a cut splits is sliced, so the prefix
    is never joined into one text (SHA-256 over bytes does not depend on how they are
    fed; each piece's UTF-8 is the text's, as ``surrogatepass`` encodes code points one
    by one)."""
    update = h.update
    digest = h.digest
    out: list[int] = []
    pos = 0  # where the current part starts in the joined text
    k = 0  # the next part
    off = 0  # how much of part ``k`` is fed already
    for c in cuts:
        while pos + len(parts[k]) <= c:  # parts that end inside the block
            part = parts[k]
            update(_bytes(part[off:] if off else part))
            pos += len(part)
            off = 0
            k += 1
            if k == len(parts):
                break
        else:
            if c > pos + off:  # the cut splits part ``k``
                update(_bytes(parts[k][off : c - pos]))
                off = c - pos
        out.append(_u64(digest())[0])
    return out


class PrefixHasher:
    """Turns text into keyed chained block hashes; one per deployment secret ``salt``.

    ``block_chars`` is the block size in characters (512-16,384). Bigger blocks hash
    faster (fewer digests) but match earlier prompts more coarsely.
    """

    def __init__(self, salt: bytes, block_chars: int = DEFAULT_BLOCK_CHARS) -> None:
        if len(salt) < 16:
            raise ConfigError(
                f"the routing salt is {len(salt)} bytes; give at least 16 random bytes "
                "(e.g. `head -c 32 /dev/urandom | base64`)"
            )
        if not 512 <= block_chars <= 16384:
            raise ConfigError(f"block_chars {block_chars} is outside 512-16384; use 2048")
        self.block_chars = block_chars
        base = hashlib.sha256()
        # A full 64-byte first compression block of key material: a secret-prefix MAC
        # whose output is truncated to 64 bits (so length extension does not apply).
        base.update(hashlib.sha512(b"preheat-router-v1" + salt).digest())
        self._base = base
        self._seed_cache: dict[str, int] = {}
        self._starts: dict[tuple[str | None, str | None], Any] = {}
        # Opt-in (``remember_parts``): chains of prefixes made of the same strings.
        self._memo: _Memo | None = None
        self._memo_entries = 0

    def remember_parts(self, entries: int) -> None:
        """Remember the keys of up to ``entries`` prefixes, keyed by the strings they are
        made of (the memo's dict keys; LRU), so a prompt built from the same strings as
        an earlier one is not hashed again. Cheap where the strings are the same objects
        (the fleet simulator: a family's shared prefix is one string, whose hash Python
        caches); an equal new string is hashed and compared in full, so it is exact but
        no cheaper than SHA-256. The memo keeps those strings, i.e. prompt text, in
        memory: off by default, and the router never turns it on. Only a prefix that ends
        at or before the start of the request's last message is remembered (a stream of
        unique questions does not fill it). 0 turns it off."""
        if entries < 0:
            raise ConfigError(
                f"remember_parts entries {entries} is negative; give 0 to turn it off"
            )
        self._memo = {} if entries else None
        self._memo_entries = entries

    def _start(self, model: str | None, cache_salt: str | None) -> Any:
        """A fresh hash state keyed by the salt, the model and the cache_salt."""
        if not (model or cache_salt):
            return self._base.copy()
        k = (model, cache_salt)
        started = self._starts.get(k)
        if started is None:
            started = self._base.copy()
            started.update(f"{_SEP}m{model or ''}{_SEP}s{cache_salt or ''}{_SEP}".encode())
            if len(self._starts) >= 1024:
                self._starts.clear()
            self._starts[k] = started
        return started.copy()

    def chain(
        self,
        text: str,
        prefix_length: int,
        *,
        boundaries: Sequence[int] = (),
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefixKey:
        """Hash the first ``prefix_length`` characters of ``text`` as a block chain.

        Cuts fall every ``block_chars`` characters from the start of each segment, and
        at each of the ascending ``boundaries`` (message ends) that lies at least
        ``MIN_CUT`` characters after the previous cut, and at the end. The cuts inside
        a prefix depend only on that prefix, so a prompt that extends an earlier one
        (the next turn of a chat) repeats every earlier hash up to its last message.
        """
        return self.chain_parts(
            (text,),
            len(text),
            prefix_length,
            boundaries=boundaries,
            model=model,
            cache_salt=cache_salt,
        )

    def cuts(self, n: int, boundaries: Sequence[int] = ()) -> list[int]:
        """Where the blocks of an ``n``-character prefix end (see ``chain``)."""
        bc = self.block_chars
        cuts: list[int] = []
        add = cuts.append
        last = 0  # the last cut (0: none yet)
        for end in boundaries:
            if end >= n:
                break  # the end of the prefix closes it below
            pos = last + bc
            while pos < end:
                add(pos)
                last = pos
                pos += bc
            if end - last >= MIN_CUT:
                add(end)
                last = end
        pos = last + bc
        while pos < n:
            add(pos)
            last = pos
            pos += bc
        if n > last:
            add(n)
        return cuts

    def chain_parts(
        self,
        parts: Sequence[str],
        total: int,
        prefix_length: int,
        *,
        boundaries: Sequence[int] = (),
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefixKey:
        """``chain("".join(parts), ...)`` without joining; ``total`` is the joined length.

        One incremental SHA-256 pass over the parts up to ``prefix_length``, each fed
        whole unless a block's cut splits it (``_digests``: no joined copy of the
        prefix), and each block's hash is a ``digest()`` of the running state (hashlib
        finalises a copy)."""
        n = min(total, prefix_length)
        memo = self._memo
        mk: tuple[Any, ...] | None = None
        if memo is not None and n > 0 and len(boundaries) > 1 and n <= boundaries[-2]:
            # The key: everything the chain depends on (the cuts follow from n and the
            # boundaries before it), and the strings themselves (``remember_parts``).
            below = 0
            for end in boundaries:
                if end >= n:
                    break
                below += 1
            k, _ = _covering(parts, n)
            lead = tuple(parts[:k])
            mk = (model, cache_salt, n, tuple(boundaries[:below]))
            mk += lead
            hit = memo.pop(mk, None)
            if hit is not None:
                memo[mk] = hit  # the most recent last (LRU)
                return PrefixKey(hit[1], n, total, False, hit[2])
        cuts = self.cuts(n, boundaries)
        h = self._start(model, cache_salt)
        if not cuts:
            return PrefixKey(
                chain=(_u64(h.digest())[0],), prefix_chars=n, prompt_chars=total, cuts=(0,)
            )
        chain = tuple(_digests(h, parts, cuts))
        ct = tuple(cuts)
        if mk is not None and memo is not None:
            memo[mk] = (lead, chain, ct)
            if len(memo) > self._memo_entries:
                del memo[next(iter(memo))]
        # Positional: a NamedTuple built with keywords costs twice as much.
        return PrefixKey(chain, n, total, False, ct)

    def hint(self, hint: str, *, prompt_chars: int = 0) -> PrefixKey:
        """The key for a caller-supplied prefix id (``X-Preheat-Prefix-Id``)."""
        h = self._base.copy()
        h.update(f"{_SEP}hint{_SEP}{hint}".encode("utf-8", "surrogatepass"))
        return PrefixKey(
            chain=(int.from_bytes(h.digest()[:8], "little"),),
            prefix_chars=0,
            prompt_chars=prompt_chars,
            hinted=True,
            cuts=(prompt_chars,),
        )

    def seed(self, instance_id: str) -> int:
        """The rendezvous seed of an instance: a keyed hash of its stable id (its URL)."""
        s = self._seed_cache.get(instance_id)
        if s is None:
            h = self._base.copy()
            h.update(f"{_SEP}instance{_SEP}{instance_id}".encode())
            s = int.from_bytes(h.digest()[:8], "little")
            if len(self._seed_cache) > 65536:
                self._seed_cache.clear()
            self._seed_cache[instance_id] = s
        return s


def rank(key: int, seeds: Sequence[int]) -> list[int]:
    """Indices into ``seeds`` from the highest to the lowest rendezvous score for ``key``."""
    scores = [score(key, s) for s in seeds]
    return sorted(range(len(seeds)), key=scores.__getitem__, reverse=True)
