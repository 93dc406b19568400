"""The node agent's view of the cluster's peer settings (ConfigMap ``preheat-settings``,
key ``settings.yaml``), read by every warm-up and at most every ``RECHECK_S`` seconds by
the reconcile loop.

A ``settings.yaml`` that does not parse or validate is made visible, not just logged:

- the agent keeps the **last valid settings** it read (the defaults when it never read
  any: peers on, one origin fill per revision), so a typo neither fails warm-ups nor
  lifts the origin budget;
- its ``NodeCache`` says so: ``Degraded=True``, reason ``InvalidPeerSettings``, the error
  as the message (``kubectl get nodecache NODE -o jsonpath='{.status.conditions}'``);
- it emits one ``Warning`` Event ``InvalidPeerSettings`` on its NodeCache per distinct
  error, and one ``Normal`` Event ``PeerSettingsValid`` once the ConfigMap is fixed
  (``kubectl describe nodecache NODE``; ``kubectl get events -A --field-selector
  involvedObject.kind=NodeCache``).

A ConfigMap that cannot be read (the API server blinked, 403) is logged and the last
settings are kept; an absent one means the defaults, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

from preheat.artifacts.refs import redact_url
from preheat.errors import ConfigError
from preheat.runtime.kubernetes.agent_config import describe_error
from preheat.runtime.kubernetes.agent_peers_config import (
    SETTINGS_KEY,
    PeerConfig,
    PeerSettings,
    parse_settings,
)
from preheat.runtime.kubernetes.crds import GROUP, VERSION

__all__ = ["EVENT_NAMESPACE", "INVALID_REASON", "RECHECK_S", "PeerSettingsReader"]

log = logging.getLogger("preheat.agent")

INVALID_REASON = "InvalidPeerSettings"
VALID_REASON = "PeerSettingsValid"
#: Events about a cluster-scoped object live in ``default``, as the kubelet's Node Events.
EVENT_NAMESPACE = "default"
#: Seconds between the reconcile loop's reads of the ConfigMap (warm-ups always read it).
RECHECK_S = 10.0
_MAX_MESSAGE = 1024


class PeerSettingsReader:
    """See the module docstring; blocking calls (run them in a thread)."""

    def __init__(self, core: Any, custom: Any, pcfg: PeerConfig, node: str) -> None:
        self.core = core
        self.custom = custom
        self.cfg = pcfg
        self.node = node
        self.last = PeerSettings()
        #: Why the ConfigMap's settings are invalid now (None: valid or absent).
        self.error: str | None = None
        self._read_at: float | None = None
        self._lock = threading.Lock()
        #: An Event that could not be written yet (e.g. no NodeCache yet): retried.
        self._unsent: tuple[str, str, str] | None = None

    @property
    def where(self) -> str:
        return f"ConfigMap {self.cfg.namespace}/{self.cfg.settings}"

    def read(self) -> PeerSettings:
        """The settings to use now (see the module docstring)."""
        from kubernetes.client.exceptions import ApiException

        with self._lock:
            self._read_at = time.monotonic()
            if self._unsent is not None:
                self._event(*self._unsent)
            try:
                cm = self.core.read_namespaced_config_map(self.cfg.settings, self.cfg.namespace)
            except ApiException as exc:
                if exc.status == 404:
                    self.last = PeerSettings()
                    self._valid()
                else:
                    log.warning("cannot read the peer settings: %s", describe_error(exc))
                return self.last
            try:
                self.last = parse_settings((cm.data or {}).get(SETTINGS_KEY), where=self.where)
            except ConfigError as exc:
                self._invalid(str(exc))
            else:
                self._valid()
            return self.last

    def recheck(self) -> None:
        """The reconcile loop's read, at most every ``RECHECK_S`` seconds."""
        if self._read_at is None or time.monotonic() - self._read_at >= RECHECK_S:
            self.read()

    def degraded(self) -> tuple[str, str] | None:
        """(reason, message) for the NodeCache's Degraded condition, or None."""
        if self.error is None:
            return None
        return INVALID_REASON, f"{self.error}; using the last valid peer settings"

    def _invalid(self, why: str) -> None:
        why = redact_url(why)[:_MAX_MESSAGE]
        if why == self.error:
            return
        self.error = why
        log.warning("invalid peer settings (keeping the last valid ones): %s", why)
        self._event("Warning", INVALID_REASON, f"{why}; using the last valid peer settings")

    def _valid(self) -> None:
        if self.error is None:
            return
        self.error = None
        log.info("peer settings in %s are valid again", self.where)
        self._event("Normal", VALID_REASON, f"{self.where} is valid again")

    def _event(self, kind: str, reason: str, message: str) -> None:
        """One Event on this node's NodeCache (one that fails is retried on the next read)."""
        self._unsent = (kind, reason, message)
        try:
            obj = self.custom.get_cluster_custom_object(GROUP, VERSION, "nodecaches", self.node)
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            body = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{self.node}.", "namespace": EVENT_NAMESPACE},
                "involvedObject": {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "NodeCache",
                    "name": self.node,
                    "uid": obj["metadata"]["uid"],
                    "resourceVersion": obj["metadata"].get("resourceVersion"),
                },
                "reason": reason,
                "message": message[:_MAX_MESSAGE],
                "type": kind,
                "source": {"component": "preheat-agent", "host": self.node},
                "reportingComponent": "preheat-agent",
                "reportingInstance": self.node,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            self.core.create_namespaced_event(EVENT_NAMESPACE, body)
            self._unsent = None
        except Exception as exc:
            log.warning("cannot emit the %s Event: %s", reason, describe_error(exc))
