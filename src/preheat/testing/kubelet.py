"""The kubelet stand-in: the one part of the test cluster that is **not** real Kubernetes.

One process per node (``python -m preheat.testing.kubelet --node NAME ...``, started by
:meth:`preheat.testing.kube.KubeCluster.add_node`). It plays the kubelet's part against the
real API server, controller-manager and scheduler:

* registers the ``Node`` (labels, capacity/allocatable, ``Ready=True``, an InternalIP) and
  renews its ``Lease`` in ``kube-node-lease`` every few seconds, so the real node-lifecycle
  controller keeps it Ready; when the stand-in stops, the node goes NotReady as a dead
  machine would;
* runs each pod bound to the node (``spec.nodeName``) as local processes: init containers in
  order, then every container's ``command`` + ``args`` (the image is **not** run: the host's
  commands are, with the venv's ``bin`` first on ``PATH``), its ``env`` (values,
  ``$(VAR)`` expansion as Kubernetes does it, and ``fieldRef`` for ``metadata.name``,
  ``metadata.namespace``, ``metadata.uid``, ``metadata.labels['k']``, ``spec.nodeName``,
  ``spec.serviceAccountName``, ``status.podIP``, ``status.hostIP``, and ``secretKeyRef`` /
  ``configMapKeyRef`` read from the API, ``optional`` honoured);
* gives each pod its own loopback address ``127.<node>.<hi>.<lo>`` (``status.podIP``),
  on which the process is expected to listen (pass ``$(POD_IP)`` from a ``fieldRef``);
* maps volumes to directories (``preheat.testing.kubelet_volumes``): ``hostPath``
  ``/x/y`` to ``<node dir>/x/y`` (so two nodes have separate "disks"), ``emptyDir`` to a
  per-pod directory, ``secret``/``configMap`` (``items``, ``optional``) and ``projected``
  (TokenRequest ``serviceAccountToken``, ``secret``, ``configMap``, ``downwardAPI``)
  volumes to files written from the API; each container's ``mountPath`` is replaced by
  that directory wherever it appears in its command, args, env values and ``workingDir``
  (processes share one filesystem, so nothing is mounted; ``readOnly`` is not enforced);
* gives a container that mounts its ServiceAccount's credentials at
  ``/var/run/secrets/kubernetes.io/serviceaccount`` (v1.20's admission adds the token
  Secret's volume to every pod) a ``KUBECONFIG`` written from them, since a fixed path
  cannot differ per pod on one filesystem; ``KUBERNETES_SERVICE_HOST``/``PORT`` name the
  API server;
* runs readiness probes (``httpGet`` and ``tcpSocket`` against the pod IP, with
  ``initialDelaySeconds``, ``periodSeconds``, ``failureThreshold``); liveness and startup
  probes are not run;
* writes pod status (phase, podIP, hostIP, conditions Initialized/ContainersReady/Ready,
  container states and restart counts), restarts exited containers per ``restartPolicy``
  (back-off 1 s doubling to 10 s), and finishes deletions: it stops the processes
  (SIGTERM to the process group, SIGKILL after the grace period, at most 10 s) and deletes
  the pod with grace period 0.

Not done (no kubelet is needed for what the tests check): images, resource limits,
cgroups, network namespaces, Services (no kube-proxy), exec/logs/port-forward.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from preheat.testing.kube import Rest
from preheat.testing.kubelet_volumes import (
    PodConfigError,
    env_value,
    pod_volumes,
    service_account_env,
)

__all__ = ["KubeletStandIn", "expand", "main"]

_LOOP_S = 0.2
_LEASE_S = 5.0
_LEASE_DURATION_S = 40
_STRATEGIC = "application/strategic-merge-patch+json"
_MERGE = "application/merge-patch+json"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names are replaced, unknown ones are left
    as written, ``$$`` is a literal ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(sub, text)


@dataclass
class _Container:
    spec: dict[str, Any]
    init: bool
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: str | None = None
    exit_code: int | None = None
    finished_at: str | None = None
    next_start: float = 0.0
    backoff: float = 1.0
    ready: bool = False
    probe_failures: int = 0
    next_probe: float = 0.0

    @property
    def name(self) -> str:
        return str(self.spec["name"])


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    ip: str
    dir: Path
    restart_policy: str
    containers: list[_Container]
    start_time: str = field(default_factory=_now)
    mounts: dict[str, Path] = field(default_factory=dict)
    error: str | None = None
    obj: dict[str, Any] = field(default_factory=dict)
    #: The status last written (without timestamps that only follow transitions).
    written: dict[str, Any] | None = None
    #: condition type -> (status, lastTransitionTime)
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)


class KubeletStandIn:
    """Runs one node's pods as local processes (see the module docstring)."""

    def __init__(
        self,
        rest: Rest,
        *,
        node: str,
        root: Path,
        ip_prefix: str,
        labels: dict[str, str],
        capacity: dict[str, str],
    ) -> None:
        self.rest = rest
        self.node = node
        self.root = root
        self.ip_prefix = ip_prefix
        self.host_ip = f"{ip_prefix}.0.1"
        self.labels = labels
        self.capacity = capacity
        self.pods: dict[str, _Pod] = {}
        self._next_ip = 0
        self._next_lease = 0.0
        self._stopping = False

    # --- node registration and heartbeat ----------------------------------------------

    def register(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.node,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **self.labels,
        }
        status, body = self.rest.call(
            "POST", "/api/v1/nodes", {"metadata": {"name": self.node, "labels": labels}}
        )
        if status == 409:  # a restarted stand-in: the Node is still there
            self.rest.must(
                "PATCH",
                f"/api/v1/nodes/{self.node}",
                {"metadata": {"labels": labels}},
                content_type=_MERGE,
            )
        elif status != 201:
            raise RuntimeError(f"registering node {self.node} answered {status}: {body}")
        self._node_status()
        self._renew_lease()

    def _node_status(self) -> None:
        now = _now()

        def cond(kind: str, value: str, reason: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": "kubelet stand-in (preheat.testing.kubelet)",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }

        body = {
            "status": {
                "capacity": self.capacity,
                "allocatable": self.capacity,
                "conditions": [
                    cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                    cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                    cond("PIDPressure", "False", "KubeletHasSufficientPID"),
                    cond("Ready", "True", "KubeletReady"),
                ],
                "addresses": [
                    {"type": "InternalIP", "address": self.host_ip},
                    {"type": "Hostname", "address": self.node},
                ],
                "nodeInfo": {
                    "kubeletVersion": "v1.20.2-preheat-standin",
                    "kubeProxyVersion": "v1.20.2-preheat-standin",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                    "containerRuntimeVersion": "preheat-standin://processes",
                    "osImage": "preheat kubelet stand-in",
                    "kernelVersion": os.uname().release,
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                },
            }
        }
        self.rest.must("PATCH", f"/api/v1/nodes/{self.node}/status", body, content_type=_STRATEGIC)

    def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        spec = {
            "holderIdentity": self.node,
            "leaseDurationSeconds": _LEASE_DURATION_S,
            "renewTime": _micro_now(),
        }
        status, _ = self.rest.call("PATCH", path, {"spec": spec}, content_type=_MERGE)
        if status == 404:
            self.rest.must(
                "POST",
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {"metadata": {"name": self.node}, "spec": spec},
            )
        elif status != 200:
            raise RuntimeError(f"renewing lease of {self.node} answered {status}")
        self._next_lease = time.monotonic() + _LEASE_S

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Register, then reconcile pods until SIGTERM; the pods' processes end with it."""
        self.register()
        try:
            while not self._stopping:
                try:
                    if time.monotonic() >= self._next_lease:
                        self._renew_lease()
                    self.sync()
                except (OSError, RuntimeError) as exc:
                    # The API server is briefly unreachable or refused one write: keep
                    # going, level-triggered; the next pass sees the current state.
                    print(f"kubelet stand-in {self.node}: {exc}", file=sys.stderr, flush=True)
                time.sleep(_LOOP_S)
        finally:
            for pod in list(self.pods.values()):
                self._kill(pod, grace=2.0)

    def stop(self, *_: Any) -> None:
        self._stopping = True

    def sync(self) -> None:
        """One level-triggered pass over the pods bound to this node."""
        selector = quote(f"spec.nodeName={self.node}")
        status, body = self.rest.call("GET", f"/api/v1/pods?fieldSelector={selector}")
        if status != 200:
            return  # the API server is briefly unavailable: try again next pass
        seen = set()
        for obj in body.get("items") or ():
            meta = obj["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            pod = self.pods.get(uid)
            if meta.get("deletionTimestamp"):
                grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                if pod is not None:
                    self._kill(pod, grace=min(grace, 10.0))
                    del self.pods[uid]
                self._finish_delete(meta)
                continue
            if pod is None:
                if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                pod = self._admit(obj)
                self.pods[uid] = pod
            self._step(pod)
            self._write_status(pod)
        for uid in set(self.pods) - seen:  # deleted without a grace period
            self._kill(self.pods.pop(uid), grace=0.0)

    # --- pods -------------------------------------------------------------------------

    def _admit(self, obj: dict[str, Any]) -> _Pod:
        meta, spec = obj["metadata"], obj["spec"]
        ip = (obj.get("status") or {}).get("podIP") or self._allocate_ip()
        pod_dir = self.root / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        containers = [_Container(c, True) for c in spec.get("initContainers") or ()]
        containers += [_Container(c, False) for c in spec.get("containers") or ()]
        pod = _Pod(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            ip=ip,
            dir=pod_dir,
            restart_policy=spec.get("restartPolicy") or "Always",
            containers=containers,
        )
        pod.obj = obj
        try:
            pod.mounts = self._volumes(obj, pod)
        except PodConfigError as exc:
            pod.error = str(exc)
        return pod

    def _allocate_ip(self) -> str:
        in_use = {p.ip for p in self.pods.values()}
        while True:
            self._next_ip += 1
            hi, lo = divmod(self._next_ip, 254)
            ip = f"{self.ip_prefix}.{hi + 1}.{lo + 1}"
            if ip not in in_use:
                return ip

    def _volumes(self, obj: dict[str, Any], pod: _Pod) -> dict[str, Path]:
        return pod_volumes(self.rest, self.root, self.node, obj, pod.dir)

    def _env(self, c: _Container, pod: _Pod, obj: dict[str, Any]) -> dict[str, str]:
        meta = obj["metadata"]
        fields = {
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            "metadata.uid": pod.uid,
            "spec.nodeName": self.node,
            "spec.serviceAccountName": obj["spec"].get("serviceAccountName") or "default",
            "status.podIP": pod.ip,
            "status.hostIP": self.host_ip,
        }
        for k, v in (meta.get("labels") or {}).items():
            fields[f"metadata.labels['{k}']"] = v
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOSTNAME": pod.name}
        env.update(service_account_env(self.rest, c.spec, pod.mounts, pod.dir))
        for item in c.spec.get("env") or ():
            if "value" in item:
                env[item["name"]] = self._map(c, pod, expand(str(item["value"]), env))
            elif "fieldRef" in (item.get("valueFrom") or {}):
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                if path not in fields:
                    raise PodConfigError(f"env {item['name']}: fieldRef {path} is not supported")
                env[item["name"]] = fields[path]
            elif {"secretKeyRef", "configMapKeyRef"} & set(item.get("valueFrom") or ()):
                value = env_value(self.rest, pod.namespace, item["name"], item["valueFrom"])
                if value is not None:
                    env[item["name"]] = value
            else:
                raise PodConfigError(
                    f"env {item['name']}: only value, fieldRef, secretKeyRef and "
                    "configMapKeyRef are supported"
                )
        return env

    def _map(self, c: _Container, pod: _Pod, text: str) -> str:
        """Replace each of the container's mountPaths with the directory behind it."""
        mounts = sorted(
            c.spec.get("volumeMounts") or (), key=lambda m: len(m["mountPath"]), reverse=True
        )
        for m in mounts:
            target = pod.mounts.get(m["name"])
            if target is None:
                raise PodConfigError(f"volumeMount {m['name']} names no volume of the pod")
            if m.get("subPath"):
                target = target / m["subPath"]
            text = text.replace(m["mountPath"].rstrip("/") or "/", str(target))
        return text

    def _start(self, c: _Container, pod: _Pod) -> None:
        env = self._env(c, pod, pod.obj)
        command = [str(x) for x in c.spec.get("command") or ()]
        if not command:
            raise PodConfigError(
                f"container {c.name} has no command; the stand-in runs host commands, not "
                "images, so set command (and args)"
            )
        argv = [self._map(c, pod, expand(a, env)) for a in command + list(c.spec.get("args") or ())]
        cwd = pod.dir
        if c.spec.get("workingDir"):
            cwd = Path(self._map(c, pod, c.spec["workingDir"]))
        log = (pod.dir / f"{c.name}.log").open("ab")
        try:
            c.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            raise PodConfigError(f"container {c.name}: cannot run {argv[0]!r}: {exc}") from exc
        finally:
            log.close()
        c.started_at = _now()
        c.exit_code = c.finished_at = None
        c.ready = False
        c.probe_failures = 0
        probe = c.spec.get("readinessProbe") or {}
        c.next_probe = time.monotonic() + float(probe.get("initialDelaySeconds") or 0)

    def _step(self, pod: _Pod) -> None:
        if pod.error:
            return
        now = time.monotonic()
        try:
            for c in pod.containers:
                if c.proc is not None and c.proc.poll() is not None and c.exit_code is None:
                    c.exit_code, c.finished_at, c.ready = c.proc.returncode, _now(), False
                if c.init:
                    if c.exit_code == 0:
                        continue  # done: the next init container (or the main ones) may run
                    if c.proc is None or (c.exit_code is not None and self._restart(pod, c, now)):
                        self._start(c, pod)
                    return  # main containers wait for every init container
            for c in pod.containers:
                if c.init:
                    continue
                if c.proc is None or (c.exit_code is not None and self._restart(pod, c, now)):
                    self._start(c, pod)
                elif c.exit_code is None:
                    self._probe(c, pod, now)
        except PodConfigError as exc:
            pod.error = str(exc)

    def _restart(self, pod: _Pod, c: _Container, now: float) -> bool:
        policy = pod.restart_policy
        if policy == "Never" or (policy == "OnFailure" and c.exit_code == 0):
            return False
        if c.next_start == 0.0:
            c.next_start = now + c.backoff
            c.backoff = min(c.backoff * 2, 10.0)
            return False
        if now < c.next_start:
            return False
        c.next_start = 0.0
        c.restarts += 1
        return True

    def _probe(self, c: _Container, pod: _Pod, now: float) -> None:
        probe = c.spec.get("readinessProbe")
        if not probe:
            c.ready = True
            return
        if now < c.next_probe:
            return
        c.next_probe = now + float(probe.get("periodSeconds") or 10)
        ok = self._check(probe, c, pod)
        if ok:
            c.ready, c.probe_failures = True, 0
        else:
            c.probe_failures += 1
            if c.probe_failures >= int(probe.get("failureThreshold") or 3) or not c.ready:
                c.ready = False

    def _port(self, port: Any, c: _Container) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or ():
            if p.get("name") == port:
                return int(p["containerPort"])
        raise PodConfigError(f"container {c.name}: probe port {port!r} names no containerPort")

    def _check(self, probe: dict[str, Any], c: _Container, pod: _Pod) -> bool:
        timeout = float(probe.get("timeoutSeconds") or 1)
        if "httpGet" in probe:
            get = probe["httpGet"]
            conn = http.client.HTTPConnection(pod.ip, self._port(get["port"], c), timeout=timeout)
            try:
                conn.request("GET", get.get("path") or "/")
                return 200 <= conn.getresponse().status < 400
            except OSError:
                return False
            finally:
                conn.close()
        if "tcpSocket" in probe:
            try:
                port = self._port(probe["tcpSocket"]["port"], c)
                with socket.create_connection((pod.ip, port), timeout=timeout):
                    return True
            except OSError:
                return False
        raise PodConfigError(f"container {c.name}: only httpGet and tcpSocket probes are run")

    # --- status and deletion ----------------------------------------------------------

    def _container_status(self, c: _Container) -> dict[str, Any]:
        state: dict[str, Any]
        if c.proc is None:
            state = {"waiting": {"reason": "PodInitializing" if not c.init else "Pending"}}
        elif c.exit_code is None:
            state = {"running": {"startedAt": c.started_at}}
        else:
            state = {
                "terminated": {
                    "exitCode": c.exit_code,
                    "reason": "Completed" if c.exit_code == 0 else "Error",
                    "startedAt": c.started_at,
                    "finishedAt": c.finished_at,
                }
            }
        return {
            "name": c.name,
            "image": c.spec.get("image") or "",
            "imageID": "",
            "containerID": f"standin://{c.proc.pid}" if c.proc else "",
            "ready": c.ready,
            "started": c.exit_code is None and c.proc is not None,
            "restartCount": c.restarts,
            "state": state,
        }

    def _write_status(self, pod: _Pod) -> None:
        inits = [c for c in pod.containers if c.init]
        mains = [c for c in pod.containers if not c.init]
        initialized = all(c.exit_code == 0 for c in inits)
        ready = initialized and bool(mains) and all(c.ready for c in mains)
        done = [c for c in mains if c.exit_code is not None]
        phase = "Pending"
        if pod.error:
            phase = "Failed"
        elif initialized and any(c.proc for c in mains):
            phase = "Running"
            if len(done) == len(mains) and not any(self._would_restart(pod, c) for c in mains):
                phase = "Succeeded" if all(c.exit_code == 0 for c in done) else "Failed"

        def cond(kind: str, ok: bool) -> dict[str, str]:
            return {"type": kind, "status": "True" if ok else "False"}

        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": self.host_ip,
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "startTime": pod.start_time,
            "conditions": [
                cond("Initialized", initialized),
                cond("ContainersReady", ready),
                cond("Ready", ready),
            ],
            "initContainerStatuses": [self._container_status(c) for c in inits],
            "containerStatuses": [self._container_status(c) for c in mains],
        }
        if pod.error:
            status["reason"], status["message"] = "StandInUnsupported", pod.error
        if status == pod.written:
            return
        # lastTransitionTime on each condition changes only when its status does.
        now = _now()
        body = json.loads(json.dumps(status))
        for c in body["conditions"]:
            prev = pod.transitions.get(c["type"])
            if prev is None or prev[0] != c["status"]:
                pod.transitions[c["type"]] = (c["status"], now)
            c["lastTransitionTime"] = pod.transitions[c["type"]][1]
            c["lastProbeTime"] = None
        code, _ = self.rest.call(
            "PATCH",
            f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
            {"status": body},
            content_type=_STRATEGIC,
        )
        if code == 200:
            pod.written = status

    @staticmethod
    def _would_restart(pod: _Pod, c: _Container) -> bool:
        return pod.restart_policy == "Always" or (
            pod.restart_policy == "OnFailure" and c.exit_code != 0
        )

    def _kill(self, pod: _Pod, *, grace: float) -> None:
        procs = [c.proc for c in pod.containers if c.proc is not None and c.proc.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)

    def _finish_delete(self, meta: dict[str, Any]) -> None:
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        self.rest.call(
            "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body
        )


def _rest_from_kubeconfig(path: Path, scratch: Path) -> Rest:
    config = yaml.safe_load(path.read_text())
    ctx_name = config["current-context"]
    ctx = next(c["context"] for c in config["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in config["users"] if u["name"] == ctx["user"])
    ca = scratch / "ca.crt"
    ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    return Rest(cluster["server"], user["token"], ca)


def main(argv: list[str] | None = None) -> int:
    """``python -m preheat.testing.kubelet --kubeconfig F --node N --root DIR ...``"""
    ap = argparse.ArgumentParser(description="kubelet stand-in: runs a node's pods as processes")
    ap.add_argument("--kubeconfig", type=Path, required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--root", type=Path, required=True, help="this node's directory")
    ap.add_argument("--ip-prefix", required=True, help="two octets, e.g. 127.2")
    ap.add_argument("--label", action="append", default=[], help="key=value (repeatable)")
    ap.add_argument("--cpu", default="8")
    ap.add_argument("--memory", default="32Gi")
    ap.add_argument("--pods", default="20")
    args = ap.parse_args(argv)
    labels = dict(item.split("=", 1) for item in args.label)
    args.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.root) as scratch:
        rest = _rest_from_kubeconfig(args.kubeconfig, Path(scratch))
        standin = KubeletStandIn(
            rest,
            node=args.node,
            root=args.root,
            ip_prefix=args.ip_prefix,
            labels=labels,
            capacity={"cpu": args.cpu, "memory": args.memory, "pods": str(args.pods)},
        )
        signal.signal(signal.SIGTERM, standin.stop)
        signal.signal(signal.SIGINT, standin.stop)
        standin.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
