"""The session-wide Kubernetes test cluster, shared by every ``test_k8s_*`` module.

One real v1.20.2 control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler; ``preheat.testing.kube``) is started for the whole pytest session, with
preheat's CRDs installed and no nodes, the first time a module asks for it, and stopped
(by PID) when the session ends. It saves one boot per module: about 6 s each on an idle
machine, 60-90 s at load 20.

How a Kubernetes test module uses it (the contract that keeps test order irrelevant):

* Take ``kube_session`` only through :func:`preheat.testing.kubespace.kube_share` in a
  **module-scoped** fixture::

      NS = "k8s-mine"                      # this module's own namespace
      NODES = {"mine-a": {"pool": "gpu"}}  # node names no other module uses

      @pytest.fixture(scope="module")
      def kube(kube_session: KubeCluster) -> Iterator[KubeCluster]:
          with kube_share(kube_session, namespaces=[NS], nodes=NODES) as cluster:
              yield cluster

* Put every namespaced object in the module's own namespace(s), never in ``default``;
  name nodes (hence NodeCaches) and any other cluster-scoped object with the module's own
  prefix. ``preheat-system`` (the rendered system manifests) may be used by any module:
  the share deletes it, and waits until it is gone, when the module ends.
* Nodes may be added (``add_node``), stopped (``stop_node``) and removed (``remove_node``)
  freely during the module; the share stops every stand-in the module added and deletes
  every Node, namespace, ClusterRole(Binding), Role(Binding), Lease, APIService,
  NodeCache, Revocation and CRD the module made (``preheat.testing.kubespace``).
* Processes the module starts (operators, agents, routers) are its own fixtures'
  business: stop them (by PID) in fixtures that depend on ``kube``, so they end before
  the share cleans up.

Kept on a cluster of their own: none. The RBAC exactness tests (test_k8s_cluster,
test_k8s_telemetry) pass on the shared cluster because every module's ClusterRoles and
bindings are deleted when it ends, and the aggregator and 1 s HPA sync that test_k8s_hpa
needs are flags every test cluster is started with.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.testing.kube import KubeCluster, KubeUnavailable, find_kube_bin, kube_cluster


@pytest.fixture(scope="session")
def kube_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """The session's control plane with preheat's CRDs and no nodes (see the module
    docstring for how a module takes its share)."""
    try:
        bin_dir = find_kube_bin()
    except KubeUnavailable as exc:
        pytest.skip(str(exc))
    with kube_cluster(tmp_path_factory.mktemp("kube"), crds=True, bin_dir=bin_dir) as cluster:
        yield cluster


@pytest.fixture
def web_root() -> Iterator[Path]:
    """A directory nginx's unprivileged workers can read (pytest's tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="preheat-origin-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)
