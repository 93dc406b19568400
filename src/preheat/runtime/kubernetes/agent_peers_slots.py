"""The cluster-wide origin budget across node agents: one ``coordination.k8s.io/v1`` Lease
per origin slot (``control.fanout.origin_slot_names``), in the agents' namespace.

An agent that may fill from the origin claims a slot (``holderIdentity``
``<node>/<revision>``) by creating its Lease or by updating it at the resourceVersion it
read: of two agents claiming one slot, the API server lets one win (409 for the other,
who waits). The holder renews the Lease while its fill runs and frees it (holder cleared)
when the fill ends either way; a holder that stops renewing (killed, partitioned) loses
its slot once ``leaseDurationSeconds`` pass without a change *as observed by the reader*
(the local clock, as client-go's leader election does: the agents' clocks are never
compared). Which slot to claim is the pure ``control.fanout.pick_slot``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from preheat.control.fanout import Slot

__all__ = ["SLOT_LABEL", "OriginSlots"]

log = logging.getLogger("preheat.agent")
SLOT_LABEL = "preheat.dev/origin-slot"


class OriginSlots:
    """The origin slot Leases as this agent sees them (blocking calls: run in a thread)."""

    def __init__(self, api_client: Any, namespace: str, duration: float) -> None:
        from kubernetes import client

        self.api: Any = client.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.duration = duration
        #: name -> (holder, renewTime as read, local monotonic time it was first seen).
        self._seen: dict[str, tuple[str | None, str | None, float]] = {}
        self._objs: dict[str, Any] = {}

    def read(self, names: Sequence[str]) -> list[Slot]:
        """The slots ``names`` now (a missing Lease is a free slot)."""
        listed = self.api.list_namespaced_lease(self.namespace, label_selector=f"{SLOT_LABEL}=true")
        by_name = {o.metadata.name: o for o in listed.items}
        now = time.monotonic()
        out = []
        for name in names:
            obj = by_name.get(name)
            self._objs[name] = obj
            if obj is None:
                out.append(Slot(name))
                continue
            spec = obj.spec
            holder = spec.holder_identity or None
            renew = str(spec.renew_time) if spec.renew_time is not None else None
            prev = self._seen.get(name)
            first = prev[2] if prev is not None and prev[:2] == (holder, renew) else now
            self._seen[name] = (holder, renew, first)
            duration = float(spec.lease_duration_seconds or self.duration)
            out.append(Slot(name, holder, first, duration))
        return out

    def _body(self, name: str, holder: str | None, obj: Any) -> Any:
        from kubernetes import client

        now = datetime.now(UTC)
        meta = client.V1ObjectMeta(
            name=name,
            namespace=self.namespace,
            labels={SLOT_LABEL: "true", "app.kubernetes.io/part-of": "preheat"},
            resource_version=obj.metadata.resource_version if obj is not None else None,
        )
        spec = client.V1LeaseSpec(
            holder_identity=holder,
            lease_duration_seconds=int(self.duration),
            renew_time=now,
            acquire_time=now if holder is not None else None,
        )
        return client.V1Lease(api_version="coordination.k8s.io/v1", kind="Lease",
                              metadata=meta, spec=spec)  # fmt: skip

    def claim(self, slot: Slot, holder: str) -> bool:
        """Take ``slot`` for ``holder`` (as last read); False when another agent won it."""
        from kubernetes.client.exceptions import ApiException

        obj = self._objs.get(slot.name)
        try:
            if obj is None:
                self._objs[slot.name] = self.api.create_namespaced_lease(
                    self.namespace, self._body(slot.name, holder, None)
                )
            else:
                self._objs[slot.name] = self.api.replace_namespaced_lease(
                    slot.name, self.namespace, self._body(slot.name, holder, obj)
                )
        except ApiException as exc:
            if exc.status in (404, 409):  # someone else created or updated it first
                return False
            raise
        if slot.holder not in (None, holder):
            log.info("took over origin slot %s from %s (not renewed)", slot.name, slot.holder)
        return True

    def renew(self, name: str, holder: str) -> bool:
        """Renew a slot this agent holds; False when it is no longer ours."""
        from kubernetes.client.exceptions import ApiException

        obj = self.api.read_namespaced_lease(name, self.namespace)
        if obj.spec.holder_identity != holder:
            return False
        try:
            self._objs[name] = self.api.replace_namespaced_lease(
                name, self.namespace, self._body(name, holder, obj)
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def release(self, name: str, holder: str) -> None:
        """Free a slot this agent holds (nothing when another holds it now)."""
        from kubernetes.client.exceptions import ApiException

        try:
            obj = self.api.read_namespaced_lease(name, self.namespace)
            if obj.spec.holder_identity != holder:
                return
            self.api.replace_namespaced_lease(name, self.namespace, self._body(name, None, obj))
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
