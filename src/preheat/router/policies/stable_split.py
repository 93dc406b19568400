"""When the ``stable-split`` placement splits a block for load (router/policies/stable.py,
``StablePlacement(split=True)``; pure).

``stable`` keeps a cold block (share under ``1 / HOT_SPREAD`` of a fair share) on the one
instance it was first sent to. Two or three of the heaviest such blocks (a popular RAG
document, a repository's context, its most edited file) can land on one instance in the
first requests, before their share is known: 1.2-1.5x the mean share on some seeds.
``stable-split`` gives such a block a second member, and doubles a split set whose every
member stays overloaded:

* **Trigger.** The block's target ``t`` (stable_traffic.py: ``HOT_SPREAD * share * n``)
  is at least ``SPLIT_TARGET``, and every instance of its set carries more than
  ``OVERLOAD`` above the mean of the balance load (stable_load.py: decayed requests, a
  chat's later turns counted through its first; counts of decisions replicas agree on,
  not the momentary in-flight count). The mean leaves out instances with no load yet,
  so an instance that joins does not make every other one look overloaded.
* **Members.** The members it had, then the block's plain rendezvous order: a function of
  the block and the fleet, the same in every replica whatever order it saw the requests
  in, and a fleet change moves only what the changed instance held or now wins.
* **Continuations.** A later block of the same prompt that carries at least
  ``CONTINUATION`` of the split block's target (the rest of the same document or
  template) is split alike in the same decision, without a load check of its own:
  judged one by one, the blocks of one document split at different moments in different
  replicas.
* **Hysteresis.** A split block keeps its spread while ``(1 + HYSTERESIS) * t >=
  SPLIT_TARGET`` (stable_traffic.py ``count``), so a split set does not collapse as soon
  as it has evened the load out, nor flap around the threshold.

Thresholds: ``SPLIT_TARGET`` (0.5: a block with a third of a fair share), ``OVERLOAD``
(0.05 over ``max(mean, BALANCE_FLOOR)``), ``CONTINUATION`` (0.9). Lower targets and
overloads split more (more copies, lower hit rate), higher ones miss the share bound
(docs/benchmarks.md, Router, "stable-split").

Measured (benchmarks/stable_load.py, 16 simulator runs): worst share 1.097x the mean
(``stable``: 1.51x), at 0.006-0.017 less KV hit rate. Not the default: the load it reads
is a function of decisions, so replicas that see requests in a different order can split
a few requests apart, and the divergence then feeds back through the balance weights
(in-process shuffled-order agreement 71 % on RAG where ``stable`` has 100 %; the
closed-loop, live-like streams stay at 100 %).
"""

from __future__ import annotations

from collections.abc import Sequence

from preheat.router.policies.stable_load import SessionLoad
from preheat.router.policies.stable_traffic import OVERLOAD, SPLIT_TARGET, BlockTraffic
from preheat.router.policies.stable_weights import BALANCE_FLOOR

__all__ = ["CONTINUATION", "below_mean", "follows", "overloaded"]

CONTINUATION = 0.9


def follows(traffic: BlockTraffic, h: int, parent_target: float, n: int) -> bool:
    """Whether block ``h`` carries (nearly) all of its split parent's traffic."""
    return traffic.target(h, n) >= CONTINUATION * parent_target


def _busy_mean(loads: list[float]) -> float:
    """The mean load of the instances that have any (0 when none has)."""
    busy = [v for v in loads if v > 0.0]
    return sum(busy) / len(busy) if busy else 0.0


def below_mean(load: SessionLoad, ids: Sequence[str]) -> list[bool]:
    """For each position: whether its load is at most the mean (``_busy_mean``)."""
    loads = load.loads(ids)[0]
    mean = _busy_mean(loads)
    return [v <= mean for v in loads]


def overloaded(
    traffic: BlockTraffic,
    load: SessionLoad,
    h: int,
    kept: list[int],
    ids: Sequence[str],
    n: int,
) -> bool:
    """Whether block ``h`` is heavy enough to split (``t >= SPLIT_TARGET``) and every
    instance of ``kept`` carries more than ``OVERLOAD`` above the mean load of the
    instances that have any (module header)."""
    if traffic.target(h, n) < SPLIT_TARGET:
        return False
    all_, _, m = load.loads(ids)
    mean = _busy_mean(all_)
    floor = max(mean, BALANCE_FLOOR * traffic.g * m)
    return min(all_[j] for j in kept) - mean > OVERLOAD * floor
