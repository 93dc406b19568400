"""Per-instance request load for the ``stable`` placement's balance weights, counted so
that replicas which see a chat's turns at different moments still agree (pure).

Replicas fed the same stream see most requests in the same order; what they see in a
different order is a conversation's next turn, which waits for the previous answer (the
wait differs from replica to replica). Such a turn is an **extension**: its prompt holds
an earlier request's whole prompt (that request's key is one of its chain hashes). An
extension goes where its conversation already is, so it decides nothing, but counting
it when it arrives would make the load, and so the next new prefix's weights, depend on
when each replica saw it; one divergent decision then shifts later counts, and
divergence compounds (69-79 % chat agreement with per-request counts).

So extensions are not counted when they arrive. Every other request counts 1 on its
instance, kept per **root** (the prompt's first block: a shared system prompt, a
template, a repository), and a root's requests weigh ``1 + r``, where ``r`` is the
decayed number of extensions per non-extension request under that root (a chat's
turns per conversation start, 0 for RAG or completions). The load of instance j is
``sum over roots of (1 + r_root) x non-extension requests of that root sent to j``.
With one root (a chat stream), ``r`` scales every instance alike: the balance terms,
relative to the mean, do not depend on ``r`` at all, and the counts they do depend on
are the ones every replica sees in the same order.

Bounds: ``MAX_ROOTS`` (256) roots with their per-instance counts (LRU; a root beyond
it counts with ``r`` = 0), and the key LRU the caller sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from preheat.router.prefix import PrefixKey

__all__ = ["MAX_ROOTS", "SessionLoad"]

MAX_ROOTS = 256


class SessionLoad:
    """Decayed load per instance, extensions counted through their root (module header).

    Counts are in the caller's growing unit ``g`` (the decayed-count trick of
    router/policies/stable.py); ``rescale`` divides them when the caller resets it."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        # Keys (last chain hash) of recent non-hinted requests: an insertion-ordered LRU.
        self._keys: OrderedDict[int, None] = OrderedDict()
        # root -> [non-extension count, extension count, {instance: non-extension count}]
        self._roots: OrderedDict[int, list[Any]] = OrderedDict()
        # The roots that have had an extension (a subset of ``_roots``, same entries).
        self._ext: dict[int, list[Any]] = {}
        # instance -> non-extension requests (all roots), and the same as a list in the
        # order of the ids ``loads`` was last given (that list object; None: rebuild).
        self._base: dict[str, float] = {}
        self._ids: Sequence[str] | None = None
        self._list: list[float] = []
        self._at: dict[str, int] = {}

    def is_extension(self, pk: PrefixKey) -> bool:
        """Whether the prompt holds an earlier request's whole prompt (a later turn)."""
        return not pk.hinted and not self._keys.keys().isdisjoint(pk.chain[:-1])

    def add(self, pk: PrefixKey, instance_id: str, g: float) -> None:
        """Count a request sent to ``instance_id`` (weight ``g``, the current unit)."""
        keys = self._keys
        root = pk.chain[0]
        roots = self._roots
        e = roots.get(root)
        if e is None:
            e = roots[root] = [0.0, 0.0, {}]
            if len(roots) > MAX_ROOTS:
                self._ext.pop(roots.popitem(last=False)[0], None)
        else:
            roots.move_to_end(root)
        hinted = pk.hinted
        chain = pk.chain
        # ``is_extension``, inline (the hot path).
        if not hinted and len(chain) > 1 and not keys.keys().isdisjoint(chain[:-1]):
            e[1] += g
            self._ext[root] = e
        else:
            e[0] += g
            per = e[2]
            per[instance_id] = per.get(instance_id, 0.0) + g
            v = self._base[instance_id] = self._base.get(instance_id, 0.0) + g
            j = self._at.get(instance_id)
            if j is not None and self._ids is not None:
                self._list[j] = v
        if not hinted:
            key = chain[-1]
            if key in keys:
                keys.move_to_end(key)
            else:
                keys[key] = None
                if len(keys) > self.max_keys:
                    keys.popitem(last=False)

    def loads(
        self, ids: Sequence[str], only: Sequence[int] | None = None
    ) -> tuple[list[float], float, float]:
        """(the load of each position in ``only``, in that order (None: every instance),
        the mean load over ``ids``, and that mean over the mean plain non-extension
        count: the multiplier ``1 + r`` averaged, 1 without extensions)."""
        if ids is not self._ids or len(self._list) != len(ids):
            bget = self._base.get
            self._list = [bget(x, 0.0) for x in ids]
            self._at = {x: j for j, x in enumerate(ids)}
            self._ids = ids
        base = self._list
        loads = base[:] if only is None else [base[j] for j in only]
        plain = total = sum(base)
        for nonext, ext, per in self._ext.values():
            if nonext <= 0.0:
                continue
            r = ext / nonext
            # (instances not in ``ids`` shift the mean, which moves every weight alike)
            total += r * sum(per.values())
            if only is None:
                # Every position: visit the root's instances, not the fleet.
                at = self._at
                for x, c in per.items():
                    j = at.get(x)
                    if j is not None and c:
                        loads[j] += r * c
                continue
            pget = per.get
            for i, j in enumerate(only):
                c = pget(ids[j])
                if c:
                    loads[i] += r * c
        return loads, total / len(ids), (total / plain if plain > 0 else 1.0)

    def rescale(self, g: float) -> None:
        """Divide every count by ``g`` (the caller reset its unit to 1)."""
        for x in self._base:
            self._base[x] /= g
        self._ids = None
        for e in self._roots.values():
            e[0] /= g
            e[1] /= g
            per = e[2]
            for x in per:
                per[x] /= g

    def forget(self, instance_id: str) -> None:
        """An instance left: drop its counts."""
        self._base.pop(instance_id, None)
        self._ids = None
        for e in self._roots.values():
            e[0] -= e[2].pop(instance_id, 0.0)
