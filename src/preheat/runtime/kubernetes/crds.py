"""The preheat CustomResourceDefinitions, generated from Python (``preheat k8s render --crds``).

Group ``preheat.dev``, version ``v1alpha1``, ``apiextensions.k8s.io/v1`` with a structural
``openAPIV3Schema``, the ``status`` subresource and printer columns, so that
``kubectl get inferenceendpoints,modeldatacaches,nodecaches`` shows readiness and cache
state at a glance. Kubernetes 1.20 (the test cluster) has no CEL validation rules, so the
schema checks types, ranges and enums, and the cross-field checks stay in
:mod:`preheat.control.spec` (the operator parses every spec through it). The schema
builders are :mod:`preheat.runtime.kubernetes.crd_schema`; the endpoint spec's schema is
:mod:`preheat.runtime.kubernetes.crd_endpoint` and the NodeCache status schema
:mod:`preheat.runtime.kubernetes.crd_nodecache`; this module holds the kinds, their status
schemas and printer columns.

=================== ========== =============================== ===========================
kind                scope      written by                      holds
=================== ========== =============================== ===========================
InferenceEndpoint   Namespaced user (spec), operator (status)  local-mode spec + pod overrides
ModelDataCache      Namespaced operator                        one model revision, targets
ModelImageCache     Namespaced operator                        one image digest, targets
NodeCache           Cluster    that node's agent only          the node store's inventory
Revocation          Cluster    user (spec), operator (status)  one revoked key, cluster-wide
=================== ========== =============================== ===========================
"""

from __future__ import annotations

from typing import Any

from preheat.runtime.kubernetes.crd_endpoint import endpoint_spec_schema
from preheat.runtime.kubernetes.crd_nodecache import nodecache_status_props
from preheat.runtime.kubernetes.crd_schema import (
    Schema,
    array,
    boolean,
    integer,
    node_selector,
    number,
    obj,
    string,
)

__all__ = [
    "CONDITION_TYPES",
    "GROUP",
    "KINDS",
    "VERSION",
    "custom_resource_definitions",
]

GROUP = "preheat.dev"
VERSION = "v1alpha1"
#: Every preheat object carries these conditions (API conventions: metav1.Condition).
CONDITION_TYPES = ("Ready", "CacheReady", "Progressing", "Degraded")


def _conditions() -> Schema:
    return {
        "type": "array",
        "description": "Ready, CacheReady, Progressing, Degraded (metav1.Condition shape).",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": obj(
            {
                "type": string(enum=list(CONDITION_TYPES)),
                "status": string(enum=["True", "False", "Unknown"]),
                "reason": string("CamelCase reason for the last transition."),
                "message": string("Human-readable detail; never contains a credential."),
                "lastTransitionTime": string(format="date-time"),
                "observedGeneration": integer(minimum=0),
            },
            required=("type", "status"),
        ),
    }


def _node_states() -> Schema:
    return array(
        obj(
            {
                "name": string(),
                "state": string(
                    enum=["Pending", "Filling", "Pulling", "Ready", "Failed", "Evicted"]
                ),
                "bytes": integer(minimum=0),
                "message": string(),
                "lastTransitionTime": string(format="date-time"),
            },
            required=("name", "state"),
        ),
        "Per-node state, aggregated by the operator from the nodes' NodeCache objects.",
    )


def _status(props: dict[str, Schema]) -> Schema:
    return obj(
        {"observedGeneration": integer(minimum=0), "conditions": _conditions(), **props},
        "Written by the owning controller only.",
    )


def _column(name: str, path: str, kind: str = "string", priority: int = 0) -> Schema:
    out: Schema = {"name": name, "type": kind, "jsonPath": path}
    if priority:
        out["priority"] = priority
    return out


def _condition_column(kind: str) -> Schema:
    return _column(kind, f'.status.conditions[?(@.type=="{kind}")].status')


_AGE = _column("Age", ".metadata.creationTimestamp", "date")


def _crd(
    kind: str,
    plural: str,
    short: str,
    scope: str,
    spec: Schema,
    status: Schema | None,
    columns: list[Schema],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "preheat"},
        },
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short],
                "categories": ["preheat"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}} if status is not None else {},
                    "additionalPrinterColumns": [*columns, _AGE],
                    "schema": {
                        "openAPIV3Schema": obj(
                            {
                                "apiVersion": string(),
                                "kind": string(),
                                "metadata": {"type": "object"},
                                "spec": spec,
                                **({"status": status} if status is not None else {}),
                            },
                            required=("spec",),
                        )
                    },
                }
            ],
        },
    }


def custom_resource_definitions() -> list[dict[str, Any]]:
    """The five CRDs, in apply order."""
    endpoint = _crd(
        "InferenceEndpoint",
        "inferenceendpoints",
        "ie",
        "Namespaced",
        endpoint_spec_schema(),
        _status(
            {
                "revision": string("Manifest digest the model resolved to."),
                "replicas": integer(minimum=0),
                "readyReplicas": integer(minimum=0),
                "warmNodes": integer("Target nodes that hold the revision.", 0),
                "message": string("What the operator is doing or waiting for."),
                "resolvedGeneration": integer("Generation whose sources were resolved.", 0),
                "variants": array(
                    obj(
                        {
                            "name": string(),
                            "revision": string(),
                            "digest": string("Manifest digest of the revision's snapshot."),
                            "bytes": integer(minimum=0),
                            "replicas": integer(minimum=0),
                            "readyReplicas": integer(minimum=0),
                            "warmNodes": integer(minimum=0),
                            "stable": string("The version that last finished rolling out."),
                            "failedVersions": array(string(), "Versions rolled back."),
                            "gatesOpen": array(string(), "Revisions whose cache gate opened."),
                            "gateSince": array(
                                obj({"revision": string(), "since": number(minimum=0)}),
                                "When each revision's cache gate began waiting (Unix s).",
                            ),
                        },
                        required=("name",),
                    )
                ),
            }
        ),
        [
            _condition_column("Ready"),
            _condition_column("CacheReady"),
            _column("Replicas", ".status.replicas", "integer"),
            _column("Available", ".status.readyReplicas", "integer"),
            _column("Warm Nodes", ".status.warmNodes", "integer"),
            _column("Strategy", ".spec.routing.strategy"),
            _column("Revision", ".status.revision", priority=1),
        ],
    )
    data = _crd(
        "ModelDataCache",
        "modeldatacaches",
        "mdc",
        "Namespaced",
        obj(
            {
                "source": string("Artifact ref of the model."),
                "revision": string("Manifest digest (immutable identity of the snapshot)."),
                "nodes": node_selector(exclude=True),
                "minReady": integer(minimum=0),
                "priority": integer(),
                "pin": boolean(),
                "endpoints": array(string(), "InferenceEndpoints that want this revision."),
            },
            required=("source",),
        ),
        _status(
            {
                "manifestDigest": string(),
                "bytes": integer(minimum=0),
                "targetNodes": array(string()),
                "readyNodes": integer(minimum=0),
                "nodes": _node_states(),
            }
        ),
        [
            _column("Source", ".spec.source"),
            _column("Ready Nodes", ".status.readyNodes", "integer"),
            _column("Min Ready", ".spec.minReady", "integer"),
            _condition_column("CacheReady"),
            _column("Revision", ".spec.revision", priority=1),
        ],
    )
    image = _crd(
        "ModelImageCache",
        "modelimagecaches",
        "mic",
        "Namespaced",
        obj(
            {
                "image": string("Image reference as written."),
                "digest": string("Resolved sha256 digest (caches are keyed by it)."),
                "nodes": node_selector(),
                "endpoints": array(string(), "InferenceEndpoints that use this image."),
            },
            required=("image",),
        ),
        _status(
            {
                "digest": string(),
                "targetNodes": array(string()),
                "readyNodes": integer(minimum=0),
                "nodes": _node_states(),
            }
        ),
        [
            _column("Image", ".spec.image"),
            _column("Ready Nodes", ".status.readyNodes", "integer"),
            _condition_column("Ready"),
            _condition_column("Degraded"),
            _column("Digest", ".status.digest", priority=1),
            _column("Endpoints", ".spec.endpoints", priority=1),
        ],
    )
    node = _crd(
        "NodeCache",
        "nodecaches",
        "nc",
        "Cluster",
        obj(
            {
                "node": string("The Node this store belongs to."),
                "storePath": string("Host path of the node store."),
                "capacityBytes": integer(minimum=0),
            },
            required=("node",),
        ),
        _status(nodecache_status_props()),
        [
            _column("Node", ".spec.node"),
            _column("Revisions", ".status.revisionCount", "integer"),
            _column("Used", ".status.usedBytes", "integer"),
            _column("Free", ".status.freeBytes", "integer"),
            _condition_column("Ready"),
        ],
    )
    revocation = _crd(
        "Revocation",
        "revocations",
        "rvk",
        "Cluster",
        obj(
            {
                "key": string(
                    "A model revision, snapshot manifest digest, or image/blob digest "
                    "(sha256:<hex>)."
                ),
                "reason": string("Why (shown in Events, status and pull errors)."),
            },
            required=("key",),
        ),
        _status({"appliedNodes": array(string(), "Nodes whose agent applied it to the store.")}),
        [
            _column("Key", ".spec.key"),
            _condition_column("Ready"),
            _column("Reason", ".spec.reason", priority=1),
        ],
    )
    return [endpoint, data, image, node, revocation]


#: kind -> plural, for clients.
KINDS = {
    crd["spec"]["names"]["kind"]: crd["spec"]["names"]["plural"]
    for crd in custom_resource_definitions()
}
