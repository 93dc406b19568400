"""Status conditions (metav1.Condition shape) and the Events their transitions deserve.

Pure: the caller passes ``now`` (an RFC 3339 string) and the object's generation. A
condition keeps its ``lastTransitionTime`` while its status holds (only reason/message
change); :func:`transitions` says which conditions changed status or reason, so the
operator posts one Kubernetes Event per transition a user wants to see, never one per
reconcile pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Condition", "merge_conditions", "transitions"]


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str

    @property
    def status_text(self) -> str:
        return "Unknown" if self.status is None else ("True" if self.status else "False")


def merge_conditions(
    current: Sequence[Mapping[str, Any]] | None,
    wanted: Iterable[Condition],
    *,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """The new ``status.conditions``: ``wanted`` over ``current`` (others kept as they are)."""
    old = {c.get("type"): dict(c) for c in current or ()}
    out = dict(old)
    for c in wanted:
        prev = old.get(c.type)
        same = prev is not None and prev.get("status") == c.status_text
        out[c.type] = {
            "type": c.type,
            "status": c.status_text,
            "reason": c.reason,
            "message": c.message,
            "lastTransitionTime": prev.get("lastTransitionTime", now) if same and prev else now,
            "observedGeneration": generation,
        }
    return [out[k] for k in sorted(out, key=str)]


def transitions(
    before: Sequence[Mapping[str, Any]] | None, after: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The conditions of ``after`` whose status or reason differs from ``before``."""
    old = {c.get("type"): c for c in before or ()}
    out = []
    for c in after:
        p = old.get(c["type"])
        if p is None or p.get("status") != c["status"] or p.get("reason") != c["reason"]:
            out.append(dict(c))
    return out
