"""One prompt's lookup in the precise KV index: its block hashes, and how many leading
blocks each synced instance holds (router/kvprecise.py builds it; pure).

When every synced instance reads prompts one way (one codec group, the common case),
the held counts are kept as **runs**: (blocks held, bitmask of the instances holding
exactly that many), longest first, as the index's mask walk finds them. A decision
asks only which instances hold past some point (the first runs) or what its pick holds
(one bit test per run), so nothing is written per instance; ``held`` (a mapping with
every synced instance, 0 for none) is built on first read, for readers that want it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = ["HeldChars", "Lookup", "RunsHeld"]

# (blocks held, bitmask of the instances holding exactly that many), longest first.
Runs = tuple[tuple[int, int], ...]


class RunsHeld(Mapping[str, int]):
    """``Lookup.held`` from runs: every synced instance's held blocks, built when read."""

    __slots__ = ("_by_bit", "_d", "_runs", "_zeros")

    def __init__(self, zeros: dict[str, int], runs: Runs, by_bit: Mapping[int, str]) -> None:
        self._zeros = zeros
        self._runs = runs
        self._by_bit = by_bit
        self._d: dict[str, int] | None = None

    def _dict(self) -> dict[str, int]:
        d = self._d
        if d is None:
            d = self._zeros.copy()
            by_bit = self._by_bit
            for n, mask in self._runs:
                while mask:
                    low = mask & -mask
                    d[by_bit[low]] = n
                    mask ^= low
            self._d = d
        return d

    def __getitem__(self, x: str) -> int:
        return self._dict()[x]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._zeros)


class HeldChars:
    """Prompt characters held by each synced instance that holds any (pro rata from its
    blocks), read the three ways a decision reads them: who holds at least ``c``, what
    one instance holds, all of them."""

    __slots__ = ("_bits", "_by_bit", "_d", "_runs")

    def __init__(
        self,
        runs: tuple[tuple[int, int], ...] = (),
        by_bit: Mapping[int, str] | None = None,
        bits: Mapping[str, int] | None = None,
        held: dict[str, int] | None = None,
    ) -> None:
        # runs: (characters, mask), most first; or ``held``, a plain map (several groups).
        self._runs = runs
        self._by_bit = by_bit or {}
        self._bits = bits or {}
        self._d = held

    def at_least(self, c: float) -> list[str]:
        """The instances that hold at least ``c`` characters (``c`` > 0)."""
        if self._d is not None:
            return [x for x, v in self._d.items() if v >= c]
        out = []
        by_bit = self._by_bit
        for v, mask in self._runs:
            if v < c:
                break
            while mask:
                low = mask & -mask
                out.append(by_bit[low])
                mask ^= low
        return out

    def get(self, x: str) -> int | None:
        """The characters ``x`` holds (None: no block, or not synced)."""
        if self._d is not None:
            return self._d.get(x)
        bit = self._bits.get(x, 0)
        if bit:
            for v, mask in self._runs:
                if mask & bit:
                    return v
        return None

    def items(self) -> Iterator[tuple[str, int]]:
        """(instance, characters) of every instance that holds any."""
        if self._d is not None:
            yield from self._d.items()
            return
        by_bit = self._by_bit
        for v, mask in self._runs:
            while mask:
                low = mask & -mask
                yield by_bit[low], v
                mask ^= low


@dataclass(frozen=True, slots=True)
class Lookup:
    """A prompt's block hashes, and the leading blocks each synced instance holds.

    ``groups``: per codec/scheme group, (hashes, prompt tokens, block size); ``group``:
    each synced instance's index into it. ``hashes``/``num_tokens``/``block_size`` are
    the first group's (the only one when all instances run one model). ``runs`` (one
    group only; module header) with ``by_bit``/``bits`` (bit -> instance and back, of
    the synced instances) hold what ``held`` maps out."""

    hashes: tuple[int, ...]
    num_tokens: int
    block_size: int
    held: Mapping[str, int]
    synced: frozenset[str]
    groups: tuple[tuple[tuple[int, ...], int, int], ...] = ()
    group: Mapping[str, int] = field(default_factory=dict)
    runs: Runs | None = None
    by_bit: Mapping[int, str] = field(default_factory=dict)
    bits: Mapping[str, int] = field(default_factory=dict)

    def held_chars(self, prompt_chars: int) -> dict[str, int]:
        """The held tokens of each synced instance that holds any, as prompt characters
        (pro rata); an instance holding nothing is left out (it holds 0)."""
        out = {}
        groups = self.groups
        if len(groups) <= 1:
            _, ntok, bs = groups[0] if groups else (0, self.num_tokens, self.block_size)
            d = max(ntok, 1)
            # Once per distinct count: most instances hold the same leading blocks.
            of = {n: int(n * bs * prompt_chars / d) for n in set(self.held.values()) if n}
            return {x: of[n] for x, n in self.held.items() if n}
        for x, n in self.held.items():
            if n:
                _, ntok, bs = groups[self.group[x]]
                out[x] = int(n * bs * prompt_chars / max(ntok, 1))
        return out

    def chars(self, prompt_chars: int) -> HeldChars:
        """``held_chars`` as a ``HeldChars`` (from the runs when there are runs)."""
        if self.runs is None:
            return HeldChars(held=self.held_chars(prompt_chars))
        d = max(self.num_tokens, 1)
        bs = self.block_size
        runs = tuple((int(n * bs * prompt_chars / d), m) for n, m in self.runs)
        return HeldChars(runs, self.by_bit, self.bits)

    def held_of(self, instance_id: str) -> int:
        """The leading blocks ``instance_id`` holds (0: none, or not synced)."""
        if self.runs is None:
            return self.held.get(instance_id, 0)
        bit = self.bits.get(instance_id, 0)
        if bit:
            for n, mask in self.runs:
                if mask & bit:
                    return n
        return 0

    def hashes_of(self, instance_id: str) -> tuple[int, ...]:
        return self.groups[self.group[instance_id]][0] if self.groups else self.hashes
