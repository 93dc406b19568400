"""``PodStartRecorder``: one ``StartRecord`` per engine pod start, from the API server.

It lists and watches the engine pods (``podrecords_core.ENGINE_SELECTOR``, optionally one
endpoint's) in a namespace, reads the nodes' ``NodeCache`` objects (what each agent holds)
and the ``Node`` objects (joined when, lost when), and turns every pod start into a record
with ``podrecords_core.start_record_from_pod`` and ``podrecords_context``:

- a pod's first start is recorded once it is Ready (or as a failure when it is deleted or
  fails first); every container restart is one more record (``warm_restart``,
  ``restart_count`` n); a restart count that jumps past a start never seen Ready records
  that start as failed;
- records go to ``metrics`` (a ``TelemetryMetrics``: the same ``preheat_start_*``,
  ``preheat_starts_total``, ``preheat_weights_*`` series local mode exports; ``registry``
  is its ``CollectorRegistry``), to an ``EventLog`` (the JSONL ``preheat report`` reads)
  and to ``on_record``;
- with ``probe_engines`` the engine's ``GET /startup`` on the pod IP adds its sub-second
  ``runtime_started``/``weights_loaded`` and the bytes it read.

When a snapshot arrived on a node: the revision's ``readyAt`` (the agent's), else the
NodeCache ``Ready`` transition or when this recorder first saw it held. ``image_source``:
``agent_images_status.image_held_by_node``. Nothing unseen is invented.

Threads: :meth:`start` runs one daemon thread that lists everything, watches pods from the
list's resourceVersion for ``resync_s``, and lists again (also after any error, with a
back-off), so a missed event cannot lose a start. :meth:`sync` is the same list pass once
(``preheat k8s records``). RBAC: get/list/watch pods in the namespace, list nodes and
nodecaches (all in the rendered operator ClusterRole).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preheat.errors import ConfigError
from preheat.runtime.kubernetes.agent_images_status import image_held_by_node
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.podrecords_context import (
    NODE_LOSS_WINDOW_S,
    PeerPod,
    node_is_new,
    peer_from_pod,
    start_reason,
)
from preheat.runtime.kubernetes.podrecords_core import (
    ENDPOINT_LABEL,
    ENGINE_SELECTOR,
    REVISION_ANNOTATION,
    SNAPSHOT_ANNOTATION,
    EngineStartup,
    NodeSnapshot,
    engine_startup_from_json,
    node_snapshot_from_nodecache,
    parse_time,
    restart_count,
    start_record_from_pod,
)
from preheat.telemetry.classify import StartReason
from preheat.telemetry.events import EventLog, StartRecord, read_start_records
from preheat.telemetry.prometheus import TelemetryMetrics

__all__ = ["PodStartRecorder", "append_new_records", "record_key"]

log = logging.getLogger("preheat.podrecords")
_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
#: Nodes and NodeCaches are listed again at most this often while pod events stream in.
_REFRESH_S = 1.0


@dataclass
class _PodState:
    obj: dict[str, Any]
    restarts: int
    emitted: set[int] = field(default_factory=set)


def record_key(r: StartRecord) -> tuple[str, str, int, float]:
    """What makes a start unique: endpoint, pod, restart count, scheduled time."""
    return (r.endpoint, r.replica, r.restart_count, r.scheduled)


def append_new_records(path: Path, records: Iterable[StartRecord]) -> int:
    """Append to the JSONL at ``path`` the records it does not hold yet; returns how many
    (so running ``preheat k8s records --out F`` again adds only new starts)."""
    known = {record_key(r) for r in read_start_records(path)} if path.is_file() else set()
    n = 0
    with EventLog(path) as events:
        for r in records:
            if record_key(r) not in known:
                known.add(record_key(r))
                events.append(r)
                n += 1
    return n


class PodStartRecorder:
    """Start records of engine pods (see the module docstring)."""

    def __init__(
        self,
        api_client: Any,
        namespace: str | None,
        *,
        endpoint: str | None = None,
        metrics: TelemetryMetrics | None = None,
        events: EventLog | None = None,
        on_record: Callable[[StartRecord], None] | None = None,
        probe_engines: bool = False,
        probe_timeout_s: float = 2.0,
        resync_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.namespace = namespace
        self.endpoint = endpoint
        self.selector = ENGINE_SELECTOR + (f",{ENDPOINT_LABEL}={endpoint}" if endpoint else "")
        self.metrics = metrics if metrics is not None else TelemetryMetrics()
        self.events = events
        self.on_record = on_record
        self.probe_engines = probe_engines
        self.probe_timeout_s = probe_timeout_s
        self.resync_s = resync_s
        self.clock = clock
        #: Every record this recorder made, in order.
        self.records: list[StartRecord] = []
        self.api_errors = 0
        self._lock = threading.Lock()
        self._pods: dict[str, _PodState] = {}
        self._peers: dict[str, PeerPod] = {}
        self._nodecaches: dict[str, dict[str, Any]] = {}
        self._first_held: dict[tuple[str, str], float | None] = {}
        self._nodes_created: dict[str, float] = {}
        self._lost: dict[str, float] = {}
        self._listed_caches = False
        self._refreshed = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def registry(self) -> Any:
        """The ``prometheus_client.CollectorRegistry`` with the start metrics."""
        return self.metrics.registry

    # --- reading the API ----------------------------------------------------------------

    def _raw(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*a, _preload_content=False, **kw)
        except ApiException as exc:
            self.api_errors += 1
            if exc.status in (401, 403):
                raise ConfigError(
                    f"the API server refused {fn.__name__} ({exc.status} {exc.reason}); "
                    "bind these credentials to the rendered preheat-operator ClusterRole "
                    "(pods, nodes, nodecaches: get/list/watch)"
                ) from None
            raise
        body: dict[str, Any] = json.loads(resp.data)
        return body

    def _refresh_cluster(self, *, force: bool = False) -> None:
        """List Nodes and NodeCaches (at most every ``_REFRESH_S`` unless ``force``)."""
        now = self.clock()
        if not force and now - self._refreshed < _REFRESH_S:
            return
        self._refreshed = now
        nodes = self._raw(self.core.list_node)["items"]
        present = set()
        for n in nodes:
            name = n["metadata"]["name"]
            present.add(name)
            created = parse_time(n["metadata"].get("creationTimestamp"))
            if created is not None:
                self._nodes_created[name] = created
            ready = next(
                (c for c in n.get("status", {}).get("conditions") or () if c["type"] == "Ready"),
                None,
            )
            if ready is not None and ready.get("status") != "True":
                lost = parse_time(ready.get("lastTransitionTime"))
                self._lost[name] = lost if lost is not None else now
            else:
                self._lost.pop(name, None)
        for name in set(self._nodes_created) - present:  # deleted: lost from now on
            self._lost.setdefault(name, now)
        caches = self._raw(self.custom.list_cluster_custom_object, GROUP, VERSION, "nodecaches")
        self._nodecaches = {
            str((c.get("spec") or {}).get("node") or c["metadata"]["name"]): c
            for c in caches["items"]
        }
        for node, obj in self._nodecaches.items():
            for entry in (obj.get("status") or {}).get("revisions") or ():
                key = (node, str(entry.get("revision")))
                if entry.get("state") == "Ready" and key not in self._first_held:
                    # Held at the first list: since before we looked (no time known).
                    self._first_held[key] = now if self._listed_caches else None
        self._listed_caches = True

    def _node_snapshot(self, pod: dict[str, Any]) -> NodeSnapshot:
        node = (pod.get("spec") or {}).get("nodeName")
        ann = (pod.get("metadata") or {}).get("annotations") or {}
        snap = node_snapshot_from_nodecache(
            self._nodecaches.get(node or ""),
            snapshot=ann.get(SNAPSHOT_ANNOTATION),
            revision=ann.get(REVISION_ANNOTATION),
        )
        if not snap.held:
            return snap
        entries = (self._nodecaches[node or ""].get("status") or {}).get("revisions") or ()
        keys = {ann.get(REVISION_ANNOTATION), ann.get(SNAPSHOT_ANNOTATION)}
        mine = [e for e in entries if str(e.get("revision")) in keys]
        if any(e.get("readyAt") for e in mine):
            return snap  # the agent wrote when it arrived: exact, not observed
        seen = [self._first_held.get((node or "", str(e.get("revision")))) for e in mine]
        times = [t for t in (snap.ready_at, *seen) if t is not None]
        return NodeSnapshot(True, min(times) if times else None, snap.size_bytes)

    def _probe(self, pod: dict[str, Any]) -> EngineStartup | None:
        ip = (pod.get("status") or {}).get("podIP")
        containers = (pod.get("spec") or {}).get("containers") or ()
        engine = next((c for c in containers if c.get("name") == "engine"), None) or (
            containers[0] if containers else {}
        )
        ports = engine.get("ports") or ()
        port = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else None)
        if not ip or port is None:
            return None
        url = f"http://{ip}:{port['containerPort']}/startup"
        try:
            with urllib.request.urlopen(url, timeout=self.probe_timeout_s) as resp:
                return engine_startup_from_json(json.loads(resp.read()))
        except (OSError, ValueError) as exc:
            log.info("no /startup from %s: %s", url, exc)
            return None

    # --- turning pods into records ------------------------------------------------------

    def _record(self, pod: dict[str, Any], failure: str | None) -> StartRecord | None:
        peer = peer_from_pod(pod)
        reason, new = StartReason.INITIAL, False
        if restart_count(pod) == 0:
            peers = list(self._peers.values())
            reason = start_reason(peer, peers, lost_nodes=self._lost)
            new = node_is_new(peer, peers, self._nodes_created.get(peer.node or ""))
        startup = self._probe(pod) if self.probe_engines and failure is None else None
        try:
            return start_record_from_pod(
                pod,
                node=self._node_snapshot(pod),
                startup=startup,
                reason=reason,
                node_is_new=new,
                failure=failure,
                image_held=image_held_by_node(pod, self._nodecaches),
            )
        except ValueError as exc:
            log.warning("cannot record the start of pod %s: %s", peer.name, exc)
            return None

    def _emit(self, rec: StartRecord | None, out: list[StartRecord]) -> None:
        if rec is None:
            return
        with self._lock:
            self.records.append(rec)
        self.metrics.observe_start(rec)
        if self.events is not None:
            self.events.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        out.append(rec)

    def observe(self, pod: dict[str, Any], *, deleted: bool = False) -> list[StartRecord]:
        """Take one pod object (an event or a list item); returns the records it made."""
        meta = pod["metadata"]
        uid = str(meta.get("uid") or meta["name"])
        n = restart_count(pod)
        out: list[StartRecord] = []
        st = self._pods.get(uid)
        if st is not None and n > st.restarts and st.restarts not in st.emitted:
            why = f"engine container exited before the pod was Ready (restart {n})"
            self._emit(self._record(st.obj, why), out)
            st.emitted.add(st.restarts)
        if st is None:
            st = self._pods[uid] = _PodState(pod, n)
        st.obj, st.restarts = pod, n
        gone = deleted or bool(meta.get("deletionTimestamp"))
        self._peers[uid] = peer_from_pod(pod, deleted_at=self.clock() if deleted else None)
        if n not in st.emitted:
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or ()
            )
            rec = self._record(
                pod, "pod deleted before it became Ready" if gone and not ready else None
            )
            if rec is not None:
                st.emitted.add(n)
            self._emit(rec, out)
        if deleted:
            del self._pods[uid]
        self._prune()
        return out

    def _prune(self) -> None:
        cutoff = self.clock() - 2 * NODE_LOSS_WINDOW_S
        for uid, p in list(self._peers.items()):
            if p.deleted_at is not None and p.deleted_at < cutoff:
                del self._peers[uid]

    def _pod_list(self) -> tuple[Any, ...]:
        """The list call for engine pods: one namespace, or every namespace when None
        (the operator's cluster-wide mode)."""
        if self.namespace is None:
            return (self.core.list_pod_for_all_namespaces,)
        return (self.core.list_namespaced_pod, self.namespace)

    def sync(self) -> list[StartRecord]:
        """One full pass: list nodes, NodeCaches and the engine pods, record what is new
        (pods gone since the last pass count as deleted); returns the new records."""
        self._refresh_cluster(force=True)
        listed = self._raw(*self._pod_list(), label_selector=self.selector)
        self._resource_version = str(listed["metadata"].get("resourceVersion") or "")
        items = list(listed["items"])
        for pod in items:  # every listed pod is a peer before any is classified
            uid = str(pod["metadata"].get("uid") or pod["metadata"]["name"])
            self._peers.setdefault(uid, peer_from_pod(pod))
        out: list[StartRecord] = []
        present = set()
        for pod in sorted(items, key=lambda p: str(p["metadata"].get("creationTimestamp"))):
            present.add(str(pod["metadata"].get("uid") or pod["metadata"]["name"]))
            out += self.observe(pod)
        for uid in set(self._pods) - present:
            out += self.observe(self._pods[uid].obj, deleted=True)
        return out

    # --- watching -----------------------------------------------------------------------

    def _watch_once(self) -> None:
        from kubernetes import watch

        self.sync()
        w = watch.Watch()
        for ev in w.stream(
            *self._pod_list(),
            label_selector=self.selector,
            resource_version=self._resource_version,
            timeout_seconds=max(1, int(self.resync_s)),
        ):
            if self._stop.is_set():
                w.stop()
                return
            kind, raw = ev["type"], ev.get("raw_object")
            if kind == "ERROR" or not isinstance(raw, dict):
                return  # e.g. 410 Gone: list again
            self._resource_version = str(raw["metadata"].get("resourceVersion") or "")
            if kind == "BOOKMARK":
                continue
            self._refresh_cluster()
            self.observe(raw, deleted=kind == "DELETED")

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._watch_once()
                failures = 0
            except Exception as exc:  # the API server restarting, a refused list, a blip
                failures += 1
                self.api_errors += 1
                log.warning("pod start recorder: %s; listing again", exc)
                self._stop.wait(_BACKOFF_S[min(failures, len(_BACKOFF_S)) - 1])

    def start(self) -> None:
        """Watch in a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pod-records", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def snapshot(self) -> list[StartRecord]:
        """A copy of every record made so far (safe from any thread)."""
        with self._lock:
            return list(self.records)
