"""Connecting to the Kubernetes API server: credentials, namespace, API discovery.

Credentials: ``--kubeconfig``, else ``KUBECONFIG`` or ``~/.kube/config``, else the pod's
in-cluster ServiceAccount. Errors are ``ConfigError`` naming where the credentials came
from and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from preheat.errors import ConfigError

__all__ = ["IN_CLUSTER_NAMESPACE", "connect", "discovery_version"]

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def connect(kubeconfig: Path | None = None) -> tuple[client.ApiClient, str | None]:
    """An API client from ``kubeconfig``, else ``KUBECONFIG``/``~/.kube/config``, else the
    in-cluster ServiceAccount; with the namespace of the kubeconfig context or the pod."""
    if kubeconfig is not None and not kubeconfig.is_file():
        raise ConfigError(f"--kubeconfig {kubeconfig} does not exist; give a kubeconfig file")
    default = Path(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0])
    file = kubeconfig or (default.expanduser() if default.expanduser().is_file() else None)
    try:
        if file is not None:
            api = config.new_client_from_config(config_file=str(file))
            _, active = config.list_kube_config_contexts(config_file=str(file))
            return api, (active or {}).get("context", {}).get("namespace")
        conf = client.Configuration()
        config.load_incluster_config(client_configuration=conf)
    except ConfigException as exc:
        where = f"kubeconfig {file}" if file is not None else "the in-cluster ServiceAccount"
        raise ConfigError(
            f"cannot load Kubernetes credentials from {where}: {exc}; give --kubeconfig, "
            "set KUBECONFIG, or run in a pod with a ServiceAccount"
        ) from None
    ns = IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.is_file() else None
    return client.ApiClient(conf), ns


def discovery_version(api: client.ApiClient) -> str:
    """``v1`` when the API server serves ``discovery.k8s.io/v1``, else ``v1beta1``."""
    try:
        groups = client.ApisApi(api).get_api_versions().groups or []
    except ApiException as exc:
        raise ConfigError(f"API discovery failed ({exc.status} {exc.reason})") from None
    except urllib3.exceptions.HTTPError as exc:
        raise ConfigError(
            f"cannot reach the Kubernetes API server {api.configuration.host}: "
            f"{getattr(exc, 'reason', None) or exc}; check the kubeconfig's server address"
        ) from None
    for g in groups:
        if g.name == "discovery.k8s.io":
            versions = {v.version for v in g.versions or ()}
            for want in ("v1", "v1beta1"):
                if want in versions:
                    return want
    raise ConfigError(
        "the API server serves no discovery.k8s.io/v1 or v1beta1 (EndpointSlices); "
        "Kubernetes 1.17 or newer is needed"
    )
