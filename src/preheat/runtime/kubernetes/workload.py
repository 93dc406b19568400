"""The objects the operator creates for an endpoint, as plain dicts (pure: no I/O).

Per endpoint model revision a ``ModelDataCache``; per variant a ``Deployment`` and a
``Service``. Everything carries an owner reference to the ``InferenceEndpoint`` so the
garbage collector removes it with the endpoint, and the labels below.

The engine pod (a contract other components rely on):

* labels ``app.kubernetes.io/name: preheat``, ``app.kubernetes.io/component: engine``,
  ``preheat.dev/endpoint``, ``preheat.dev/variant``; annotations ``preheat.dev/revision``
  (the manifest digest it runs), ``preheat.dev/snapshot`` (the same digest: the node
  agent leases that snapshot for the pod) and ``preheat.dev/version`` (revision plus
  engine/image fingerprint: what a rollout rolls);
* **preferred** node affinity (never required) for nodes labelled
  ``preheat.dev/rev-<12 hex>`` (the agent's label for a node that holds the revision);
* the node store as a read-only ``hostPath`` at :data:`STORE_HOST_PATH`, and an init
  container (``preheat snapshot-init``) that links the node's snapshot into a pod-local
  ``emptyDir`` when the node holds it, or else pulls the revision from the origin into
  that directory (HyperPod's fallback: a slower start, not a failed pod); with ``peers``
  (the cluster's ``preheat-settings`` say peers are on) that pull takes its pieces from
  the node agents first: the init container gets ``--peer-token-file`` (the
  ``preheat-peer-token`` Secret of the endpoint's namespace, read-only, optional: without
  it the pull is from the origin) and ``--peers-from-nodecaches`` (the pod's
  ServiceAccount reads NodeCaches: ``preheat-engine`` in ``render.py``);
* ``pod.env`` (the endpoint's override) in both the init container and the engine, after
  preheat's own variables (the origin's credentials, from a Secret, go there);
* the engine's command from the endpoint's template (``{snapshot}``, ``{port}``,
  ``{host}``, ``{model}``, ``{replica}``), listening on ``$(POD_IP)``:``ENGINE_PORT``,
  with a readiness probe on ``/health``; an engine whose command publishes KV events
  (``preheat engine serve --kv-events tcp://...:P[?replay=tcp://...:R]``, or vLLM's
  ``--kv-events-config`` JSON ``endpoint``/``replay_endpoint``) also gets container ports
  ``kv-events`` (P) and ``kv-replay`` (R), and so does the variant's Service: its
  EndpointSlices then carry them, which router discovery reads (``discovery.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from preheat.artifacts.manifest import revision_hex
from preheat.control.spec_types import EndpointSpec, VariantSpec
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_status import SNAPSHOT_ANNOTATION, revision_label
from preheat.runtime.kubernetes.workload_engine import (
    ENGINE_PORT,
    SNAPSHOT_PATH,
    WEIGHTS_MOUNT,
    engine_argv,
    kv_event_ports,
)

__all__ = [
    "ENGINE_PORT",
    "PEER_TOKEN_DIR",
    "PEER_TOKEN_SECRET",
    "REVISION_ANNOTATION",
    "SPEC_REPLICAS_ANNOTATION",
    "STORE_HOST_PATH",
    "VERSION_ANNOTATION",
    "WEIGHTS_MOUNT",
    "cache_body",
    "cache_name",
    "deployment_body",
    "engine_argv",
    "kv_event_ports",
    "pod_labels",
    "replica_count",
    "service_body",
    "template_fingerprint",
]

STORE_HOST_PATH = "/var/lib/preheat/store"
REVISION_ANNOTATION = "preheat.dev/revision"
VERSION_ANNOTATION = "preheat.dev/version"
ENDPOINT_LABEL = "preheat.dev/endpoint"
VARIANT_LABEL = "preheat.dev/variant"
CACHE_REVISION_LABEL = "preheat.dev/revision"
DEFAULT_IMAGE = "preheat:0.1.0"
#: On the Deployment: the spec's replica count the operator last applied.
SPEC_REPLICAS_ANNOTATION = "preheat.dev/spec-replicas"
#: The cluster peer token (docs/peers.md), as a Secret of the same name in the endpoint's
#: namespace (a pod mounts Secrets of its own namespace only), mounted here.
PEER_TOKEN_SECRET = "preheat-peer-token"
PEER_TOKEN_DIR = "/etc/preheat/peer"

Body = dict[str, Any]


def template_fingerprint(v: VariantSpec) -> str:
    """Fingerprint of how a replica runs (engine and image): part of the version, as in
    local mode (``runtime.model``), so an engine or image change rolls the pods."""
    text = json.dumps([type(v.engine).__name__, dataclasses.asdict(v.engine), v.image])
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def cache_name(endpoint: str, revision: str) -> str:
    """``ENDPOINT-<12 hex>`` (a DNS name; a long endpoint name keeps 40 characters and a
    digest of the whole, so two endpoints never share a name)."""
    name = f"{endpoint}-{revision_hex(revision)[:12]}"
    if len(name) <= 63:
        return name
    tag = hashlib.sha256(endpoint.encode()).hexdigest()[:8]
    return f"{endpoint[:40].rstrip('-')}-{tag}-{revision_hex(revision)[:12]}"


def owner_reference(endpoint: Mapping[str, Any]) -> Body:
    meta = endpoint["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceEndpoint",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(endpoint: Mapping[str, Any], name: str, labels: Mapping[str, str]) -> Body:
    return {
        "name": name,
        "namespace": endpoint["metadata"]["namespace"],
        "labels": dict(labels),
        "ownerReferences": [owner_reference(endpoint)],
    }


def cache_body(endpoint: Mapping[str, Any], spec: EndpointSpec, revision: str, source: str) -> Body:
    """The ``ModelDataCache`` of one revision of the endpoint (targets: ``modelCacheConfig``)."""
    w = spec.cache.weights
    nodes: Body = {}
    if w.nodes.names:
        nodes["names"] = list(w.nodes.names)
    elif w.nodes.labels:
        nodes["selector"] = dict(w.nodes.labels)
    labels = {
        "app.kubernetes.io/part-of": "preheat",
        ENDPOINT_LABEL: spec.name,
        CACHE_REVISION_LABEL: revision_hex(revision)[:63],
    }
    body: Body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelDataCache",
        "metadata": _meta(endpoint, cache_name(spec.name, revision), labels),
        "spec": {
            "source": source,
            "revision": revision,
            "nodes": nodes,
            "priority": w.priority,
            "pin": w.pin,
            "endpoints": [spec.name],
        },
    }
    if w.min_ready is not None:
        body["spec"]["minReady"] = w.min_ready
    return body


def pod_labels(endpoint: str, variant: str) -> dict[str, str]:
    """The engine pods' labels (also the Deployment's selector and the Service's)."""
    return {
        "app.kubernetes.io/name": "preheat",
        "app.kubernetes.io/component": "engine",
        ENDPOINT_LABEL: endpoint,
        VARIANT_LABEL: variant,
    }


_FIELD_ENV = [
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
]


def deployment_body(
    endpoint: Mapping[str, Any],
    spec: EndpointSpec,
    variant: VariantSpec,
    *,
    name: str,
    revision: str,
    digest: str,
    source: str,
    replicas: int,
    pod: Mapping[str, Any] | None = None,
    max_surge: int = 1,
    progress_deadline_s: int = 600,
    spec_replicas: int | None = None,
    peers: bool = False,
) -> Body:
    """The variant's Deployment running ``revision`` (whose snapshot has the manifest
    ``digest``; see the module docstring) with ``replicas`` pods; ``spec_replicas`` (the
    spec's own count, default ``replicas``) is recorded for :func:`replica_count`; with
    ``peers`` a cold pod's pull tries the node agents' peers before the origin."""
    labels = pod_labels(spec.name, variant.name)
    version = f"{revision}#{template_fingerprint(variant)}"
    argv = engine_argv(variant, spec.name)
    image = variant.image or DEFAULT_IMAGE
    overrides = dict(pod or {})
    user_env = [dict(e) for e in overrides.get("env") or ()]
    store_mount = {"name": "store", "mountPath": STORE_HOST_PATH, "readOnly": True}
    weights_mount = {"name": "weights", "mountPath": WEIGHTS_MOUNT}
    init: Body = {
        "name": "snapshot",
        "image": DEFAULT_IMAGE,
        "command": ["preheat"],
        "args": [
            "snapshot-init",
            "--store",
            STORE_HOST_PATH,
            "--source",
            "$(PREHEAT_SOURCE)",
            "--revision",
            revision,
            "--digest",
            digest,
            "--out",
            SNAPSHOT_PATH,
        ],
        # The source goes in the environment, not in the args that `kubectl get pod` shows
        # in every listing (a credential in a source URL belongs in a Secret-backed env).
        "env": [{"name": "PREHEAT_SOURCE", "value": source}, *user_env],
        "volumeMounts": [store_mount, weights_mount],
    }
    volumes: list[Body] = [
        {"name": "store", "hostPath": {"path": STORE_HOST_PATH, "type": "DirectoryOrCreate"}},
        {"name": "weights", "emptyDir": {}},
    ]
    if peers:
        init["args"] += [
            "--peer-token-file", f"{PEER_TOKEN_DIR}/token", "--peers-from-nodecaches",
        ]  # fmt: skip
        init["volumeMounts"].append(
            {"name": "peer-token", "mountPath": PEER_TOKEN_DIR, "readOnly": True}
        )
        volumes.append(
            {
                "name": "peer-token",
                "secret": {"secretName": PEER_TOKEN_SECRET, "defaultMode": 0o400, "optional": True},
            }
        )
    engine: Body = {
        "name": "engine",
        "image": image,
        "command": argv[:1],
        "args": argv[1:],
        "env": [*_FIELD_ENV, *user_env],
        "ports": [
            {"name": n, "containerPort": p}
            for n, p in [("http", ENGINE_PORT), *kv_event_ports(argv)]
        ],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "volumeMounts": [store_mount, weights_mount],
    }
    if overrides.get("resources"):
        engine["resources"] = overrides["resources"]
    pod_spec: Body = {
        "affinity": {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "preference": {
                            "matchExpressions": [
                                {"key": revision_label(digest), "operator": "Exists"}
                            ]
                        },
                    }
                ]
            }
        },
        "initContainers": [init],
        "containers": [engine],
        "volumes": volumes,
        "terminationGracePeriodSeconds": 10,
    }
    for key in ("tolerations", "nodeSelector", "serviceAccountName"):
        if overrides.get(key):
            pod_spec[key] = overrides[key]
    meta = _meta(endpoint, name, labels)
    meta["annotations"] = {
        SPEC_REPLICAS_ANNOTATION: str(replicas if spec_replicas is None else spec_replicas)
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "progressDeadlineSeconds": progress_deadline_s,
            "revisionHistoryLimit": 3,
            "strategy": {
                "type": "RollingUpdate",
                # Surge first, never below the desired count (as local mode rolls).
                "rollingUpdate": {"maxSurge": max(1, max_surge), "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": dict(labels),
                    "annotations": {
                        SNAPSHOT_ANNOTATION: digest,
                        REVISION_ANNOTATION: revision,
                        VERSION_ANNOTATION: version,
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def replica_count(spec_replicas: int, deployment: Mapping[str, Any] | None, *,
                  autoscaled: bool) -> int:  # fmt: skip
    """The count the operator asks of a variant's Deployment.

    The spec's own count on create and whenever that count changed (the Deployment's
    :data:`SPEC_REPLICAS_ANNOTATION` says which count was applied last); otherwise the
    Deployment's current count, so a HorizontalPodAutoscaler or ``kubectl scale`` that
    changed it is never fought. With ``autoscaled`` (the spec has ``autoscaling``: an HPA
    owns the count) only the create sets it.
    """
    if deployment is None:
        return spec_replicas
    current = (deployment.get("spec") or {}).get("replicas")
    if not isinstance(current, int):
        return spec_replicas
    if autoscaled:
        return current
    applied = ((deployment.get("metadata") or {}).get("annotations") or {}).get(
        SPEC_REPLICAS_ANNOTATION
    )
    return current if applied == str(spec_replicas) else spec_replicas


def service_body(endpoint: Mapping[str, Any], spec: EndpointSpec, variant: str, name: str) -> Body:
    """The Service in front of one variant's pods (the router reads its EndpointSlices),
    with the engine's ``kv-events``/``kv-replay`` ports when it publishes KV events."""
    labels = pod_labels(spec.name, variant)
    kv = kv_event_ports(engine_argv(spec.variant(variant), spec.name))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(endpoint, name, labels),
        "spec": {
            "selector": dict(labels),
            "ports": [
                {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
                *({"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in kv),
            ],
        },
    }
