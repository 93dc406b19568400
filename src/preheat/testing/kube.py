"""A real Kubernetes v1.20.2 control plane on 127.0.0.1 for tests and the walkthrough.

What is real: etcd, kube-apiserver, kube-controller-manager and kube-scheduler, built from
Debian's source package by ``scripts/build-kube.sh`` and started here with fresh state (a
temporary directory: PKI, token file, service-account keys, etcd data). RBAC is on, so
permissions are checked exactly as in a cluster.

What is not real: the kubelet. :meth:`KubeCluster.add_node` starts one
:mod:`preheat.testing.kubelet` process per node, a stand-in that registers the ``Node``,
renews its ``Lease`` (so the real node-lifecycle controller keeps it Ready and removes the
not-ready taint, and a node whose stand-in stops goes NotReady as in a cluster), and runs
the pods bound to it as local processes on their own 127.x.y.z address.

Nothing routes Service ClusterIPs here (no kube-proxy); talk to pod IPs (127.0.0.0/8) only.

Resource handling: every daemon runs in its own session (``setsid``) and is stopped by PID
in :meth:`KubeCluster.stop` (also on a failed start), stand-ins first so they can end
their pods' processes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from preheat.runtime.kubernetes.crds import custom_resource_definitions
from preheat.runtime.procs import start_process
from preheat.testing.kubewait import until
from preheat.testing.procs import Process, free_port

__all__ = [
    "KUBE_VERSION",
    "KubeCluster",
    "KubeUnavailable",
    "Rest",
    "find_kube_bin",
    "kube_cluster",
]

KUBE_VERSION = "1.20.2"
_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
#: Service ClusterIPs come from here; nothing routes them (there is no kube-proxy).
SERVICE_CIDR = "10.96.0.0/16"


class KubeUnavailable(RuntimeError):
    """The control plane binaries or etcd are missing; the message says how to get them."""


def find_kube_bin(cache: Path | None = None) -> Path:
    """The directory holding the cached 1.20.2 binaries, or raise KubeUnavailable."""
    root = cache or Path(os.environ.get("PREHEAT_CACHE", Path.home() / ".cache" / "preheat"))
    bin_dir = root / "kube" / KUBE_VERSION / "bin"
    missing = [b for b in _BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise KubeUnavailable(
            f"{', '.join(missing)} not in {bin_dir}; run scripts/build-kube.sh "
            "(about 7.5 minutes once, then cached)"
        )
    if shutil.which("etcd") is None:
        raise KubeUnavailable("etcd is not installed; run scripts/install-sysdeps.sh")
    if shutil.which("openssl") is None:
        raise KubeUnavailable("openssl is not installed; run scripts/install-sysdeps.sh")
    return bin_dir


class Rest:
    """A small JSON client for the API server (bearer token, the cluster's CA).

    Tests use it to act as a given identity (admin, a ServiceAccount) and to see the HTTP
    status the server answers, 403 included.
    """

    def __init__(self, server: str, token: str, ca_file: Path) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self._ctx = ssl.create_default_context(cafile=str(ca_file))

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float = 10.0,
    ) -> tuple[int, Any]:
        """Send one request; returns ``(status, decoded JSON body or None)``; never raises
        for an HTTP error status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        """GET that must succeed; raises RuntimeError naming the path and status."""
        status, body = self.call("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}: {body}")
        return body

    def must(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """A write that must succeed (2xx)."""
        status, out = self.call(method, path, body, **kw)
        if not 200 <= status < 300:
            raise RuntimeError(f"{method} {path} answered {status}: {out}")
        return out


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_pki(pki: Path) -> None:
    """A cluster CA with the API server's serving cert, a front-proxy CA, and the
    service-account signing key pair (ECDSA P-256: an RSA key costs about 1 s of CPU
    each on a loaded 2-core machine; valid for 2 days: test state only)."""
    pki.mkdir(parents=True)
    for ca, cn in (("ca", "preheat-test-ca"), ("front-proxy-ca", "preheat-front-proxy-ca")):
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
            "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-subj", f"/CN={cn}",
            cwd=pki,
        )  # fmt: skip
    (pki / "san.cnf").write_text(
        "[ext]\nsubjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "apiserver.key",
        "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver", cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", "apiserver.crt",
        "-extfile", "san.cnf", "-extensions", "ext", cwd=pki,
    )  # fmt: skip
    # The aggregator's client certificate towards extension API servers (the metrics
    # adapter): signed by the front-proxy CA, CN in --requestheader-allowed-names.
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "front-proxy-client.key",
        "-out", "front-proxy-client.csr", "-subj", "/CN=front-proxy-client", cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "front-proxy-client.csr", "-CA", "front-proxy-ca.crt",
        "-CAkey", "front-proxy-ca.key", "-CAcreateserial", "-days", "2",
        "-out", "front-proxy-client.crt", cwd=pki,
    )  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, *, server: str, ca_file: Path, token: str, user: str) -> Path:
    """A kubeconfig with one cluster, one token user and one current context."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "preheat-test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_file.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "preheat-test", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


@dataclass
class _Daemon:
    name: str
    proc: Process
    log: Path


@dataclass
class KubeCluster:
    """A running control plane; build with :meth:`start`, end with :meth:`stop`."""

    root: Path
    bin_dir: Path
    server: str
    ca_file: Path
    admin_token: str
    kubeconfig: Path
    daemons: list[_Daemon] = field(default_factory=list)
    kubelets: dict[str, _Daemon] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: Second octet of the first node's pod addresses, drawn per cluster so two clusters
    #: on one machine (parallel test runs) do not hand out the same 127.x.y.z:port.
    ip_base: int = field(default_factory=lambda: 2 + secrets.randbelow(190))
    nodes_added: int = 0
    #: The second octet each stand-in got, and those freed by :meth:`remove_node` (its
    #: stand-in and pods are gone), handed out again first: a session-wide cluster whose
    #: modules add and remove nodes keeps within a few octets.
    octets: dict[str, int] = field(default_factory=dict)
    free_octets: list[int] = field(default_factory=list)

    # --- lifecycle --------------------------------------------------------------------

    @classmethod
    def start(
        cls, root: Path, *, bin_dir: Path | None = None, timeout: float = 60.0
    ) -> KubeCluster:
        """Start etcd, kube-apiserver, kube-controller-manager and kube-scheduler with fresh
        state under ``root`` and wait until each is ready (``timings`` holds the seconds)."""
        bin_dir = bin_dir or find_kube_bin()
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        pki = root / "pki"
        _make_pki(pki)
        tokens = {u: secrets.token_hex(16) for u in ("admin", "controller-manager", "scheduler")}
        (pki / "tokens.csv").write_text(
            f"{tokens['admin']},admin,uid-admin,system:masters\n"
            f"{tokens['controller-manager']},system:kube-controller-manager,uid-kcm\n"
            f"{tokens['scheduler']},system:kube-scheduler,uid-sched\n"
        )
        secure_port = free_port()
        server = f"https://127.0.0.1:{secure_port}"
        ca = pki / "ca.crt"
        kubeconfig = write_kubeconfig(
            root / "admin.kubeconfig",
            server=server,
            ca_file=ca,
            token=tokens["admin"],
            user="admin",
        )
        cluster = cls(root, bin_dir, server, ca, tokens["admin"], kubeconfig)
        cluster.timings["pki"] = time.monotonic() - t0
        try:
            cluster._boot(tokens, secure_port, timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.timings["total"] = time.monotonic() - t0
        return cluster

    def _spawn(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> _Daemon:
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # The one launcher (runtime.procs): its own session, stopped by PID, and SIGTERM
        # when the test process dies, so a killed pytest leaves no control plane behind.
        proc = start_process(
            list(argv), log, env=env, inherit_env=env is None, die_with_parent=True
        )
        return _Daemon(name, proc, log)

    def _wait(self, what: str, daemon: _Daemon | None, ok: Any, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        last: object = None
        while time.monotonic() < deadline:
            if daemon is not None and not daemon.proc.running:
                tail = daemon.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{daemon.name} exited with code {daemon.proc.returncode}; log tail:\n{tail}"
                )
            try:
                if ok():
                    self.timings[what] = time.monotonic() - start
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        log = f"; see {daemon.log}" if daemon else ""
        raise RuntimeError(f"{what} not ready within {timeout:g} s ({last}){log}")

    def _healthz(self, port: int) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the component's self-signed serving cert
        try:
            with urllib.request.urlopen(
                f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=2
            ) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False

    def _boot(self, tokens: dict[str, str], secure_port: int, timeout: float) -> None:
        pki = self.root / "pki"
        client_port, peer_port = free_port(), free_port()
        etcd = self._spawn(
            "etcd",
            [
                "etcd",
                "--name=preheat-test",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client_port}",
                f"--advertise-client-urls=http://127.0.0.1:{client_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=preheat-test=http://127.0.0.1:{peer_port}",
                "--log-level=warn",
            ],
        )
        self.daemons.append(etcd)

        def etcd_ok() -> bool:
            url = f"http://127.0.0.1:{client_port}/health"
            with urllib.request.urlopen(url, timeout=2) as r:
                return bool(json.loads(r.read()).get("health") == "true")

        self._wait("etcd", etcd, etcd_ok, timeout)

        api = self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{client_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={secure_port}",
                "--insecure-port=0",
                f"--cert-dir={pki / 'apiserver-certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--profiling=false",
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--v=1",
            ],
        )
        self.daemons.append(api)
        admin = self.rest()

        def api_ok() -> bool:
            status, _ = admin.call("GET", "/readyz", timeout=2)
            return status == 200

        self._wait("kube-apiserver", api, api_ok, timeout)

        kcm_conf = write_kubeconfig(
            self.root / "controller-manager.kubeconfig",
            server=self.server,
            ca_file=self.ca_file,
            token=tokens["controller-manager"],
            user="system:kube-controller-manager",
        )
        kcm_port = free_port()
        kcm = self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kcm_conf}",
                f"--authentication-kubeconfig={kcm_conf}",
                f"--authorization-kubeconfig={kcm_conf}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                "--port=0",
                f"--cert-dir={pki / 'kcm-certs'}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # The CSR signer would need the CA key; nothing here issues node certs.
                "--controllers=*,-csrsigning",
                # HPAs (test_k8s_hpa) are evaluated every second, not every 15 s.
                "--horizontal-pod-autoscaler-sync-period=1s",
                "--v=1",
            ],
        )
        self.daemons.append(kcm)

        sched_conf = write_kubeconfig(
            self.root / "scheduler.kubeconfig",
            server=self.server,
            ca_file=self.ca_file,
            token=tokens["scheduler"],
            user="system:kube-scheduler",
        )
        sched_port = free_port()
        sched = self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                f"--kubeconfig={sched_conf}",
                f"--authentication-kubeconfig={sched_conf}",
                f"--authorization-kubeconfig={sched_conf}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                "--port=0",
                f"--cert-dir={pki / 'sched-certs'}",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        self.daemons.append(sched)
        # Both start at once (neither needs the other): on a loaded machine each takes
        # seconds to answer /healthz.
        self._wait("kube-controller-manager", kcm, lambda: self._healthz(kcm_port), timeout)
        self._wait("kube-scheduler", sched, lambda: self._healthz(sched_port), timeout)

        # 1.20's ServiceAccount admission rejects pods until the namespace's default
        # ServiceAccount has its token Secret (the controller-manager creates it).
        def token_ok() -> bool:
            status, body = admin.call("GET", "/api/v1/namespaces/default/serviceaccounts/default")
            return status == 200 and bool(body.get("secrets"))

        self._wait("default-serviceaccount-token", None, token_ok, timeout)

    def stop(self) -> None:
        """Stop the kubelet stand-ins (they end their pods), then the control plane, by PID,
        newest first; safe to call twice."""
        for daemon in list(self.kubelets.values()):
            daemon.proc.stop(10)
        for daemon in reversed(self.daemons):
            daemon.proc.stop(10)

    # --- clients ----------------------------------------------------------------------

    def install_crds(self, timeout: float = 30.0) -> None:
        """Apply preheat's CRDs (as ``preheat k8s render --crds`` prints them) and wait
        until the API server serves every one of them."""
        crds = custom_resource_definitions()
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(crds))
        names = [f"crd/{c['metadata']['name']}" for c in crds]
        self.kubectl("wait", "--for=condition=Established", f"--timeout={timeout:.0f}s", *names)

    def rest(self, token: str | None = None) -> Rest:
        """A JSON client acting as admin, or as the holder of ``token``."""
        return Rest(self.server, token or self.admin_token, self.ca_file)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the matched kubectl 1.20 with the admin kubeconfig."""
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}"
            )
        return proc

    def service_account_token(self, namespace: str, name: str, timeout: float = 30.0) -> str:
        """The token of a ServiceAccount (1.20 keeps it in an auto-created Secret)."""
        admin = self.rest()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sa = admin.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
            for ref in sa.get("secrets") or ():
                secret = admin.get(f"/api/v1/namespaces/{namespace}/secrets/{ref['name']}")
                token = (secret.get("data") or {}).get("token")
                if token:
                    return base64.b64decode(token).decode()
            time.sleep(0.1)
        raise RuntimeError(f"ServiceAccount {namespace}/{name} got no token in {timeout:g} s")

    def sa_kubeconfig(self, path: Path, namespace: str, name: str) -> Path:
        """Write a kubeconfig at ``path`` that acts as ServiceAccount ``namespace/name``
        (its token), as the component running under it would in a cluster."""
        token = self.service_account_token(namespace, name)
        return write_kubeconfig(
            path, server=self.server, ca_file=self.ca_file, token=token, user=name
        )

    # --- nodes (the kubelet stand-in) ---------------------------------------------------

    def add_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        cpu: str = "8",
        memory: str = "32Gi",
        pods: int = 20,
        timeout: float = 30.0,
    ) -> Path:
        """Register a Node run by a kubelet stand-in process; returns the node's directory
        (hostPath volumes of its pods live under it). Waits until the node is Ready and
        schedulable (the real node-lifecycle controller removed the not-ready taint)."""
        if name in self.kubelets:
            raise ValueError(f"node {name!r} already has a kubelet stand-in")
        # A stopped node's octet is never reused (its pods may still hold their
        # addresses); a removed node's is (its stand-in ended its pods).
        octet = self.free_octets.pop(0) if self.free_octets else self.ip_base + self.nodes_added
        if octet > 254:
            raise ValueError(
                f"at most {255 - self.ip_base} nodes: each gets the pod addresses 127.<n>.x.y"
            )
        node_dir = self.root / "nodes" / name
        node_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "preheat.testing.kubelet",
            f"--kubeconfig={self.kubeconfig}",
            f"--node={name}",
            f"--root={node_dir}",
            f"--ip-prefix=127.{octet}",
            f"--cpu={cpu}",
            f"--memory={memory}",
            f"--pods={pods}",
        ]
        for k, v in (labels or {}).items():
            argv.append(f"--label={k}={v}")
        env = dict(os.environ)
        # Pods run the host's commands (`preheat engine serve`): the venv's bin comes first.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        daemon = self._spawn(f"kubelet-{name}", argv, env)
        self.kubelets[name] = daemon
        if octet == self.ip_base + self.nodes_added:
            self.nodes_added += 1
        self.octets[name] = octet
        admin = self.rest()

        def ready() -> bool:
            status, node = admin.call("GET", f"/api/v1/nodes/{name}")
            if status != 200:
                return False
            conds = {c["type"]: c["status"] for c in node["status"].get("conditions") or ()}
            taints = node["spec"].get("taints") or ()
            return conds.get("Ready") == "True" and not taints

        self._wait(f"node {name}", daemon, ready, timeout)
        return node_dir

    def stop_node(self, name: str) -> None:
        """Stop a node's kubelet stand-in (its pods' processes end with it); the Node object
        stays and turns NotReady once its Lease expires, as when a machine dies."""
        daemon = self.kubelets.pop(name)
        daemon.proc.stop(10)
        self.octets.pop(name, None)  # not reused: the Node and its pods' addresses stay

    def remove_node(self, name: str, timeout: float = 30.0) -> None:
        """Take a node out of the cluster for good: stop its stand-in (if it still runs),
        delete the ``Node`` and its heartbeat ``Lease``, and wait until the Node is gone."""
        daemon = self.kubelets.pop(name, None)
        if daemon is not None:
            daemon.proc.stop(10)
        octet = self.octets.pop(name, None)
        if octet is not None and daemon is not None and daemon.proc.returncode == 0:
            self.free_octets.append(octet)  # a clean exit: its pods' processes ended
        admin = self.rest()
        for path in (
            f"/api/v1/nodes/{name}",
            f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}",
        ):
            status, body = admin.call("DELETE", path)
            if status not in (200, 202, 404):
                raise RuntimeError(f"DELETE {path} answered {status}: {body}")
        self.wait_for(
            f"node {name} deleted",
            lambda: admin.call("GET", f"/api/v1/nodes/{name}")[0] == 404,
            timeout,
        )

    def create_namespace(self, name: str, timeout: float = 60.0) -> None:
        """Create a namespace and wait until pods can be created in it (1.20's
        ServiceAccount admission needs its ``default`` ServiceAccount's token Secret).
        A namespace that already exists is an error: it belongs to someone else."""
        admin = self.rest()
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        status, out = admin.call("POST", "/api/v1/namespaces", body)
        if status == 409:
            raise ValueError(
                f"namespace {name!r} already exists on the test cluster: give this module "
                "a namespace of its own (tests/integration/conftest.py)"
            )
        if status != 201:
            raise RuntimeError(f"creating namespace {name} answered {status}: {out}")

        def token() -> bool:
            code, sa = admin.call("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
            return code == 200 and bool(sa.get("secrets"))

        self.wait_for(f"namespace {name}'s default ServiceAccount token", token, timeout)

    def wait_for(self, what: str, ok: Any, timeout: float = 60.0) -> Any:
        """Poll ``ok()`` until it returns a truthy value (returned), or raise naming ``what``
        (an exception from ``ok`` ends the wait at once)."""
        return until(what, ok, timeout, not_yet=())


@contextlib.contextmanager
def kube_cluster(
    root: Path,
    *,
    nodes: Mapping[str, Mapping[str, str]] | None = None,
    crds: bool = False,
    **kw: Any,
) -> Iterator[KubeCluster]:
    """Start a cluster under ``root`` (with ``nodes``: name -> labels, each run by a kubelet
    stand-in, and preheat's CRDs installed when ``crds``) and stop it (by PID) when the
    block ends."""
    cluster = KubeCluster.start(root, **kw)
    try:
        for name, labels in (nodes or {}).items():
            cluster.add_node(name, labels=labels)
        if crds:
            cluster.install_crds()
        yield cluster
    finally:
        cluster.stop()


def forbidden_in(log: str) -> bool:
    """A 403 or Forbidden in a component's log (not the ",403" of a timestamp's ms)."""
    return bool(re.search(r"(?<![\d,.])403(?!\d)|Forbidden", log))
