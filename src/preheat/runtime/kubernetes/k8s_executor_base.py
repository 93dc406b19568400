"""What the Kubernetes executor's parts share (:mod:`.k8s_executor`): its configuration,
the API helpers, the per-pass record ``_Pass`` and the executor's memory between passes
(``ExecutorBase``); :mod:`.k8s_observe` and :mod:`.k8s_sync` build on it."""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from preheat.control.spec_types import EndpointSpec
from preheat.control.state import Desired, Observed, OpenGate, WaitGate
from preheat.runtime.kubernetes import endpoint_status as es
from preheat.runtime.kubernetes.revocations import ImageRevocations
from preheat.runtime.kubernetes.workload import ENDPOINT_LABEL

__all__ = ["EmitFn", "ExecutorBase", "OperatorConfig"]

#: (object body, "Normal" | "Warning", reason, message) -> posts a Kubernetes Event.
EmitFn = Callable[[dict[str, Any], str, str, str], None]

_CACHES = "modeldatacaches"
_MERGE = "application/merge-patch+json"
_ENDPOINTS = "inferenceendpoints"


@dataclass(frozen=True)
class OperatorConfig:
    rollout_deadline_s: int = 600
    tick_s: float = 2.0


@dataclass
class _Pass:
    """What one pass learned, for ``commit``."""

    endpoint: dict[str, Any] | None = None
    spec: EndpointSpec | None = None
    pod: dict[str, Any] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    nodecaches: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)
    desired: Desired | None = None
    observed: Observed | None = None
    gates: dict[str, WaitGate | OpenGate] = field(default_factory=dict)
    unschedulable: dict[str, str] = field(default_factory=dict)
    problem: tuple[str, str] | None = None  # (reason, message) that stops planning
    #: variant -> (fallback revision or None, message): the planner's ``Revoked`` actions.
    revoked: dict[str, tuple[str | None, str]] = field(default_factory=dict)


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _short(revision: str) -> str:
    return revision.removeprefix("sha256:")[:12]


def _compact(obj: Any) -> Any:
    """Without empty strings and ``None`` (the 1.20 test API server stores an empty string
    as null and then refuses the object: "must be of type string")."""
    if isinstance(obj, dict):
        return {k: _compact(v) for k, v in obj.items() if v is not None and v != ""}
    if isinstance(obj, list):
        return [_compact(v) for v in obj]
    return obj


class ExecutorBase:
    """The state of one endpoint's executor and the API helpers every part uses."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        *,
        emit: EmitFn,
        config: OperatorConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.namespace, self.name = namespace, name
        self.emit = emit
        self.config = config or OperatorConfig()
        self.clock = clock
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.memory: dict[str, es.VariantMemory] = {}
        self.resolved: dict[str, es.Resolved] = {}
        self.resolved_generation = -1
        #: variant -> its ``model.fallback`` resolved (only once a revocation needs it),
        #: and the generation it was resolved for.
        self.fallbacks: dict[str, list[es.Resolved]] = {}
        self.fallbacks_generation = -1
        #: The endpoint's image digests and ``image.fallback`` lists (revocations).
        self.images = ImageRevocations()
        #: variant -> the last ``Revoked`` message an Event was posted for.
        self.revoked_said: dict[str, str] = {}
        self.notices: list[str] = []
        self.p = _Pass()
        self.actions: dict[str, int] = {}
        #: Called with each action's type name (the operator's metrics).
        self.on_action: Callable[[str], None] = lambda _kind: None

    # --- API helpers ------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(fn, *a, **kw)

    async def _list(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> list[dict[str, Any]]:
        out = await self._call(fn, *a, _preload_content=False, **kw)
        return list(json.loads(out.data).get("items") or ())

    def _selector(self) -> str:
        return f"{ENDPOINT_LABEL}={self.name}"

    def _count(self, action: object) -> None:
        kind = type(action).__name__
        self.actions[kind] = self.actions.get(kind, 0) + 1
        self.on_action(kind)

    def _resolved_rev(self, revision: str) -> es.Resolved | None:
        """The resolution of ``revision``: a variant's model or one of its fallbacks."""
        for r in self.resolved.values():
            if r.revision == revision:
                return r
        for fbs in self.fallbacks.values():
            for r in fbs:
                if r.revision == revision:
                    return r
        return None

    def _mem(self, variant: str) -> es.VariantMemory:
        return self.memory.setdefault(variant, es.VariantMemory())
