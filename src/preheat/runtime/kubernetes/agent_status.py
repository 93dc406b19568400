"""The node agent's writes to the API about its node: the ``NodeCache`` (created when
absent; its status written only when the computed status differs from the stored one)
and the Node's ``preheat.dev/rev-<12 hex>`` labels, one per snapshot held. The bodies
come from the pure :mod:`.nodecache_body` and :mod:`.nodecache_status`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from preheat.artifacts.refs import redact_url
from preheat.runtime.kubernetes.agent_config import AgentConfig
from preheat.runtime.kubernetes.agent_metrics import AgentMetrics
from preheat.runtime.kubernetes.agent_warmups import Warmups
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_body import (
    drop_none,
    failure_condition,
    held_revisions,
    keep_free_bytes,
    nodecache_object,
    pending_revisions,
)
from preheat.runtime.kubernetes.nodecache_status import nodecache_status, revision_labels_patch
from preheat.store import NodeStore

__all__ = ["NodeCacheWriter"]

log = logging.getLogger("preheat.agent")
_MERGE = "application/merge-patch+json"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeCacheWriter:
    """The agent's ``NodeCache`` status and Node labels; ``node_labels`` is the Node's
    labels as last read (the caches' node selectors match against them)."""

    def __init__(
        self,
        cfg: AgentConfig,
        store: NodeStore,
        api: tuple[Any, Any],
        metrics: AgentMetrics,
        warmups: Warmups,
        wanted: Callable[[], dict[str, tuple[str, str | None]]],
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.core, self.custom = api
        self.metrics = metrics
        self.warmups = warmups
        self.wanted = wanted
        self.node_labels: dict[str, str] = {}
        self.written: dict[str, Any] | None = None
        #: More status fields (e.g. ``agent_peers``: ``peer``, ``warmups``), merged last.
        self.extra: list[Callable[[], dict[str, Any]]] = []
        #: (reason, message) when the node is Degraded for another cause (peer settings)
        self.degraded: Callable[[], tuple[str, str] | None] = lambda: None
        #: called with each computed status before it is compared and written (images, readyAt)
        self.extensions: list[Callable[[dict[str, Any]], None]] = []

    def _call(self, op: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except Exception:
            self.metrics.api_errors.labels(op).inc()
            raise

    def nodecache(self) -> dict[str, Any]:
        """This node's ``NodeCache`` (created when absent)."""
        from kubernetes.client.exceptions import ApiException

        args = (GROUP, VERSION, "nodecaches", self.cfg.node)
        try:
            found: Any = self.custom.get_cluster_custom_object(*args)
            return dict(found)
        except ApiException as exc:
            if exc.status != 404:  # absent on first start: created below
                self.metrics.api_errors.labels("get-nodecache").inc()
                raise
        body = nodecache_object(self.cfg.node, str(self.store.root), self.cfg.capacity)
        try:
            created = self._call(
                "create-nodecache", self.custom.create_cluster_custom_object,
                GROUP, VERSION, "nodecaches", body,
            )  # fmt: skip
            return dict(created)
        except ApiException as exc:
            if exc.status != 409:
                raise
            got: Any = self.custom.get_cluster_custom_object(*args)
            return dict(got)

    def status(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The status this node's store and warm-ups call for, given the stored ``obj``."""
        held = held_revisions(self.store.snapshots())
        pending = pending_revisions(self.warmups.warms.values())
        out = nodecache_status(
            generation=int(obj["metadata"].get("generation") or 1),
            now=_now(),
            capacity_bytes=self.cfg.capacity,
            free_bytes=self.store.free_bytes(),
            held=held,
            pending=pending,
            wanted=[redact_url(k) for k in self.wanted()],
            eviction_order=[c.digest for c in self.store.eviction_candidates()[:3]],
            last_failure=failure_condition(self.warmups.last_failure),
            previous=obj.get("status") or {},
            degraded=self.degraded(),
        )
        for fields in self.extra:
            out.update(fields())
        for extend in self.extensions:
            extend(out)
        return out

    def write_status(self) -> bool:
        """Write the NodeCache status when it changed; returns whether it wrote."""
        obj = self.nodecache()
        status = {k: drop_none(v) for k, v in self.status(obj).items()}
        keep_free_bytes(status, obj.get("status") or {})
        if drop_none(status) == drop_none(obj.get("status") or {}):
            self.written = status
            return False
        self._call(
            "patch-nodecache-status",
            self.custom.patch_cluster_custom_object_status,
            GROUP, VERSION, "nodecaches", self.cfg.node, {"status": status},
            _content_type=_MERGE,
        )  # fmt: skip
        self.metrics.status_writes.inc()
        stored = obj.get("status") or {}
        changed = sorted(k for k, v in status.items() if drop_none(stored.get(k)) != v)
        log.info("wrote NodeCache %s status (changed: %s)", self.cfg.node, ", ".join(changed))
        self.written = status
        return True

    def refresh_node(self) -> None:
        node = self._call("get-node", self.core.read_node, self.cfg.node)
        self.node_labels = dict(node.metadata.labels or {})

    def label_node(self) -> None:
        held = [i.digest for i in self.store.snapshots()]
        patch = revision_labels_patch(self.node_labels, held)
        if not patch:
            return
        self._call(
            "patch-node-labels", self.core.patch_node, self.cfg.node,
            {"metadata": {"labels": patch}}, _content_type=_MERGE,
        )  # fmt: skip
        for k, v in patch.items():
            if v is None:
                self.node_labels.pop(k, None)
            else:
                self.node_labels[k] = v
