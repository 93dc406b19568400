"""The node agent's DaemonSet (part of ``preheat k8s render``'s system set): one agent per
node on the host network, with the node store, the peer token and containerd's
``config_path`` mounted (docs/kubernetes.md, "The node agent")."""

from __future__ import annotations

from typing import Any

from preheat.runtime.kubernetes.render import (
    AGENT_PEER_PORT,
    AGENT_PORT,
    CONTAINERD_HOSTS_DIR,
    MIRROR_PORT,
    PEER_TOKEN_DIR,
    PEER_TOKEN_SECRET,
    STORE_HOST_PATH,
    _container,
    _labels,
    _origin_env_from,
)

__all__ = ["agent_daemonset"]


def agent_daemonset(namespace: str, image: str) -> dict[str, Any]:
    """The ``preheat-agent`` DaemonSet in ``namespace`` running ``image``."""
    ag = _labels("agent")
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "preheat-agent", "namespace": namespace, "labels": ag},
        "spec": {
            "selector": {"matchLabels": ag},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": ag},
                "spec": {
                    "serviceAccountName": "preheat-agent",
                    # The node's containerd (a host process) pulls through the mirror at
                    # 127.0.0.1:MIRROR_PORT: only the host network reaches that loopback
                    # (a hostPort is DNATed to the pod IP and not served on 127.0.0.1 by
                    # most CNIs), and the mirror binds loopback only, so it is not exposed.
                    "hostNetwork": True,
                    "dnsPolicy": "ClusterFirstWithHostNet",
                    # Every node that may run replicas needs its agent, GPU taints included.
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [
                        _container(
                            "agent",
                            image,
                            [
                                "agent",
                                "--node",
                                "$(NODE_NAME)",
                                "--store",
                                STORE_HOST_PATH,
                                "--port",
                                str(AGENT_PORT),
                                # peers: the token from the Secret, the URL others use
                                "--peer-port",
                                str(AGENT_PEER_PORT),
                                "--peer-host",
                                "$(POD_IP)",
                                "--peer-url",
                                f"http://$(POD_IP):{AGENT_PEER_PORT}",
                                "--peer-token-file",
                                f"{PEER_TOKEN_DIR}/token",
                                "--namespace",
                                namespace,
                                "--mirror-port",
                                str(MIRROR_PORT),
                                "--containerd-hosts-dir",
                                CONTAINERD_HOSTS_DIR,
                            ],
                            [
                                ("http", AGENT_PORT),
                                ("peers", AGENT_PEER_PORT),
                                ("mirror", MIRROR_PORT),
                            ],
                            env=[
                                {
                                    "name": "NODE_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                },
                                {
                                    "name": "POD_IP",
                                    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                                },
                            ],
                            envFrom=_origin_env_from(),
                            volumeMounts=[
                                {"name": "store", "mountPath": STORE_HOST_PATH},
                                {
                                    "name": "peer-token",
                                    "mountPath": PEER_TOKEN_DIR,
                                    "readOnly": True,
                                },
                                {"name": "containerd-hosts", "mountPath": CONTAINERD_HOSTS_DIR},
                            ],
                            resources={"requests": {"cpu": "100m", "memory": "256Mi"}},
                        )
                    ],
                    "volumes": [
                        {
                            "name": "store",
                            "hostPath": {"path": STORE_HOST_PATH, "type": "DirectoryOrCreate"},
                        },
                        {
                            "name": "peer-token",
                            "secret": {"secretName": PEER_TOKEN_SECRET, "defaultMode": 0o400},
                        },
                        {
                            "name": "containerd-hosts",
                            "hostPath": {"path": CONTAINERD_HOSTS_DIR, "type": "DirectoryOrCreate"},
                        },
                    ],
                },
            },
        },
    }
