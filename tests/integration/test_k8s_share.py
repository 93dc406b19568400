"""The session cluster's module shares (preheat.testing.kubespace): what one module makes
is gone when its share closes, so the next module finds the cluster as it was."""

from __future__ import annotations

import pytest

from preheat.control.spec import parse_endpoint
from preheat.runtime.kubernetes.resources import endpoint_object
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share, snapshot

pytestmark = pytest.mark.kubernetes

NS = "k8s-share"
FINALIZER = "preheat.dev/test-finalizer"


def test_a_closed_share_leaves_nothing_behind(kube_session: KubeCluster) -> None:
    """Inside a share: a node with a running pod, a second namespace, a ClusterRole and
    binding, a RoleBinding in kube-system, and a NodeCache and an InferenceEndpoint that
    carry a finalizer nobody will finish. After the share closes the tracked objects are
    exactly those from before, the stand-in is stopped, and the namespaces are gone."""
    before = snapshot(kube_session)
    admin = kube_session.rest()
    with kube_share(kube_session, namespaces=[NS], nodes={"share-a": {}}) as kube:
        kube.create_namespace(f"{NS}-b")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sleeper", "namespace": NS},
            "spec": {
                "nodeName": "share-a",
                "containers": [{"name": "c", "image": "x", "command": ["sleep", "600"]}],
            },
        }
        admin.must("POST", f"/api/v1/namespaces/{NS}/pods", pod)
        kube.wait_for(
            "the pod runs",
            lambda: (
                admin.get(f"/api/v1/namespaces/{NS}/pods/sleeper")["status"].get("phase")
                == "Running"
            ),
            30,
        )
        rbac = "/apis/rbac.authorization.k8s.io/v1"
        role = {"metadata": {"name": "share-reader"}, "rules": []}
        admin.must("POST", f"{rbac}/clusterroles", role)
        ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole"}
        subject = [{"kind": "ServiceAccount", "name": "default", "namespace": NS}]
        binding = {"roleRef": {**ref, "name": "share-reader"}, "subjects": subject}
        admin.must(
            "POST", f"{rbac}/clusterrolebindings", {"metadata": {"name": "share-b"}, **binding}
        )
        admin.must(
            "POST",
            f"{rbac}/namespaces/kube-system/rolebindings",
            {"metadata": {"name": "share-rb", "namespace": "kube-system"}, **binding},
        )
        meta = {"name": "share-a", "finalizers": [FINALIZER]}
        nodecache = {"apiVersion": "preheat.dev/v1alpha1", "kind": "NodeCache", "metadata": meta}
        admin.must(
            "POST",
            "/apis/preheat.dev/v1alpha1/nodecaches",
            {**nodecache, "spec": {"node": "share-a"}},
        )
        spec = parse_endpoint({"name": "held", "model": {"source": "file:///m"}}, origin="t")
        endpoint = endpoint_object(spec, namespace=NS)
        endpoint["metadata"]["finalizers"] = [FINALIZER]
        admin.must(
            "POST", f"/apis/preheat.dev/v1alpha1/namespaces/{NS}/inferenceendpoints", endpoint
        )
        assert len(snapshot(kube_session) - before) >= 8
    assert snapshot(kube_session) == before
    assert "share-a" not in kube_session.kubelets
    for ns in (NS, f"{NS}-b"):
        assert admin.call("GET", f"/api/v1/namespaces/{ns}")[0] == 404
