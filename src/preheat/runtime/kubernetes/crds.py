"""The preheat CustomResourceDefinitions, generated from Python (``preheat k8s render --crds``).

Group ``preheat.dev``, version ``v1alpha1``, ``apiextensions.k8s.io/v1`` with a structural
``openAPIV3Schema``, the ``status`` subresource and printer columns, so that
``kubectl get inferenceendpoints,modeldatacaches,nodecaches`` shows readiness and cache
state at a glance. Kubernetes 1.20 (the test cluster) has no CEL validation rules, so the
schema checks types, ranges and enums, and the cross-field checks stay in
:mod:`preheat.control.spec` (the operator parses every spec through it).

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

__all__ = [
    "CONDITION_TYPES",
    "GROUP",
    "KINDS",
    "VERSION",
    "custom_resource_definitions",
    "endpoint_spec_schema",
]

GROUP = "preheat.dev"
VERSION = "v1alpha1"
#: Every preheat object carries these conditions (API conventions: metav1.Condition).
CONDITION_TYPES = ("Ready", "CacheReady", "Progressing", "Degraded")

Schema = dict[str, Any]


def _str(description: str = "", **kw: Any) -> Schema:
    out: Schema = {"type": "string", **kw}
    if description:
        out["description"] = description
    return out


def _int(description: str = "", minimum: int | None = None, maximum: int | None = None) -> Schema:
    out: Schema = {"type": "integer", "format": "int64"}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    if description:
        out["description"] = description
    return out


def _num(description: str = "", minimum: float | None = None) -> Schema:
    out: Schema = {"type": "number"}
    if minimum is not None:
        out["minimum"] = minimum
    if description:
        out["description"] = description
    return out


def _bool(description: str = "") -> Schema:
    return {"type": "boolean", **({"description": description} if description else {})}


def _obj(props: dict[str, Schema], description: str = "", required: tuple[str, ...] = ()) -> Schema:
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if description:
        out["description"] = description
    return out


def _map(description: str = "") -> Schema:
    return {
        "type": "object",
        "additionalProperties": {"type": "string"},
        **({"description": description} if description else {}),
    }


def _list(items: Schema, description: str = "") -> Schema:
    return {
        "type": "array",
        "items": items,
        **({"description": description} if description else {}),
    }


def _free(description: str) -> Schema:
    """A field whose shape is Kubernetes' own (tolerations, resources): kept as written."""
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "description": description,
    }


def _conditions() -> Schema:
    return {
        "type": "array",
        "description": "Ready, CacheReady, Progressing, Degraded (metav1.Condition shape).",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": _obj(
            {
                "type": _str(enum=list(CONDITION_TYPES)),
                "status": _str(enum=["True", "False", "Unknown"]),
                "reason": _str("CamelCase reason for the last transition."),
                "message": _str("Human-readable detail; never contains a credential."),
                "lastTransitionTime": _str(format="date-time"),
                "observedGeneration": _int(minimum=0),
            },
            required=("type", "status"),
        ),
    }


def _node_selector() -> Schema:
    return _obj(
        {
            "names": _list(_str(), "Explicit node names."),
            "selector": _map("Node labels that must all match."),
        },
        "Target nodes: names or a label selector (empty: every node).",
    )


def _model() -> Schema:
    return _obj(
        {
            "source": _str(
                "Artifact ref: file:///dir, http(s)://.../preheat-manifest.json, s3://bucket/prefix."
            ),
            "revision": _str("Optional manifest digest the source must resolve to."),
            "fallback": _list(
                _obj(
                    {"source": _str("Artifact ref."), "revision": _str("Optional pin.")},
                    required=("source",),
                ),
                "Other allowed versions, in order, used only while this one is revoked.",
            ),
        },
        required=("source",),
    )


def _image() -> Schema:
    # Untyped: a string (the short form) or ``{ref, fallback}``; the operator validates it
    # with the same rules as a local spec (control.spec_schema) and reports what is wrong.
    return {
        "x-kubernetes-preserve-unknown-fields": True,
        "description": (
            "Container image of the engine: REGISTRY/REPO:TAG (or @sha256:...), or "
            "{ref: IMAGE, fallback: [IMAGE, ...]}: other allowed images, in order, used only "
            "while the image's digest is revoked."
        ),
    }


def _engine() -> Schema:
    return _obj(
        {
            "simulated": _obj(
                {
                    "profile": _str("Timing profile (preheat engine serve --profile)."),
                    "timeScale": _num(minimum=0),
                    "kvBlocks": _int(minimum=1),
                },
                "The built-in simulated engine.",
            ),
            "command": _str(
                "Server command template with {snapshot}, {port}, {host}, {model}, {replica}; "
                "becomes the container's command and args."
            ),
        },
        "Exactly one of simulated or command.",
    )


def _replicas() -> Schema:
    return _obj({"min": _int(minimum=0), "max": _int(minimum=1)}, "Replica bounds.")


def endpoint_spec_schema() -> Schema:
    """``InferenceEndpoint.spec``: the local-mode endpoint spec (camelCase) + pod overrides."""
    return _obj(
        {
            "model": _model(),
            "image": _image(),
            "engine": _engine(),
            "replicas": _replicas(),
            "autoscaling": _obj(
                {
                    "targetInFlight": _num(minimum=0),
                    "scaleInBelow": _num(minimum=0),
                    "cooldownSeconds": _num(minimum=0),
                },
                "Scale on router-measured in-flight requests per replica.",
                required=("targetInFlight",),
            ),
            "variants": _list(
                _obj(
                    {
                        "name": _str(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"),
                        "weight": _num(minimum=0),
                        "model": _model(),
                        "image": _image(),
                        "engine": _engine(),
                        "replicas": _replicas(),
                    },
                    required=("name",),
                ),
                "Production variants; default: one variant named main.",
            ),
            "routing": _obj(
                {
                    "strategy": _str(enum=["random", "least_outstanding", "prefix_aware"]),
                    "prefixLength": _int(minimum=1024, maximum=65536),
                    "concurrencyThreshold": _int(minimum=1, maximum=1024),
                }
            ),
            "modelCacheConfig": _obj(
                {
                    "weights": _obj(
                        {
                            "enabled": _bool(),
                            "nodes": _node_selector(),
                            "minReady": _int("Target nodes that must hold the revision first.", 0),
                            "priority": _int(),
                            "pin": _bool("Never evict this revision while it is wanted."),
                            "timeoutSeconds": _num("Then deploy anyway, CacheReady=False.", 0),
                        }
                    ),
                    "image": _obj({"enabled": _bool()}),
                }
            ),
            "pod": _obj(
                {
                    "resources": _free("Container resources (requests/limits)."),
                    "tolerations": _list(_free("A Toleration."), "Pod tolerations."),
                    "nodeSelector": _map(
                        "Required node labels (preheat's own affinity is preferred)."
                    ),
                    "serviceAccountName": _str(),
                    "env": _list(
                        _free("An EnvVar (value or valueFrom)."),
                        "Environment of the snapshot init container and the engine.",
                    ),
                },
                "Overrides for the pod template of the endpoint's Deployment.",
            ),
        },
        required=("model",),
    )


def _node_states() -> Schema:
    return _list(
        _obj(
            {
                "name": _str(),
                "state": _str(enum=["Pending", "Filling", "Pulling", "Ready", "Failed", "Evicted"]),
                "bytes": _int(minimum=0),
                "message": _str(),
                "lastTransitionTime": _str(format="date-time"),
            },
            required=("name", "state"),
        ),
        "Per-node state, aggregated by the operator from the nodes' NodeCache objects.",
    )


def _status(props: dict[str, Schema]) -> Schema:
    return _obj(
        {"observedGeneration": _int(minimum=0), "conditions": _conditions(), **props},
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
                        "openAPIV3Schema": _obj(
                            {
                                "apiVersion": _str(),
                                "kind": _str(),
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
                "revision": _str("Manifest digest the model resolved to."),
                "replicas": _int(minimum=0),
                "readyReplicas": _int(minimum=0),
                "warmNodes": _int("Target nodes that hold the revision.", 0),
                "message": _str("What the operator is doing or waiting for."),
                "resolvedGeneration": _int("Generation whose sources were resolved.", 0),
                "variants": _list(
                    _obj(
                        {
                            "name": _str(),
                            "revision": _str(),
                            "digest": _str("Manifest digest of the revision's snapshot."),
                            "bytes": _int(minimum=0),
                            "replicas": _int(minimum=0),
                            "readyReplicas": _int(minimum=0),
                            "warmNodes": _int(minimum=0),
                            "stable": _str("The version that last finished rolling out."),
                            "failedVersions": _list(_str(), "Versions rolled back."),
                            "gatesOpen": _list(_str(), "Revisions whose cache gate opened."),
                            "gateSince": _list(
                                _obj({"revision": _str(), "since": _num(minimum=0)}),
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
        _obj(
            {
                "source": _str("Artifact ref of the model."),
                "revision": _str("Manifest digest (immutable identity of the snapshot)."),
                "nodes": _node_selector(),
                "minReady": _int(minimum=0),
                "priority": _int(),
                "pin": _bool(),
                "endpoints": _list(_str(), "InferenceEndpoints that want this revision."),
            },
            required=("source",),
        ),
        _status(
            {
                "manifestDigest": _str(),
                "bytes": _int(minimum=0),
                "targetNodes": _list(_str()),
                "readyNodes": _int(minimum=0),
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
        _obj(
            {
                "image": _str("Image reference as written."),
                "digest": _str("Resolved sha256 digest (caches are keyed by it)."),
                "nodes": _node_selector(),
                "endpoints": _list(_str(), "InferenceEndpoints that use this image."),
            },
            required=("image",),
        ),
        _status(
            {
                "digest": _str(),
                "targetNodes": _list(_str()),
                "readyNodes": _int(minimum=0),
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
        _obj(
            {
                "node": _str("The Node this store belongs to."),
                "storePath": _str("Host path of the node store."),
                "capacityBytes": _int(minimum=0),
            },
            required=("node",),
        ),
        _status(
            {
                "capacityBytes": _int(minimum=0),
                "usedBytes": _int(minimum=0),
                "freeBytes": _int(minimum=0),
                "revisionCount": _int(minimum=0),
                "revisions": _list(
                    _obj(
                        {
                            "revision": _str(),
                            "source": _str("Redacted source ref (no credentials)."),
                            "bytes": _int(minimum=0),
                            "state": _str(enum=["Filling", "Ready", "Failed", "Evicting"]),
                            "pinned": _bool(),
                            "leases": _int(minimum=0),
                            "lastUsed": _str(format="date-time"),
                            "readyAt": _str("When the snapshot arrived.", format="date-time"),
                        },
                        required=("revision", "state"),
                    )
                ),
                "images": _list(
                    _obj(
                        {
                            "image": _str("registry/repository:tag (or @digest), normalised."),
                            "digest": _str("What the tag resolved to (resolved once)."),
                            "bytes": _int(minimum=0),
                            "state": _str(enum=["Pulling", "Ready", "Failed"]),
                            "readyAt": _str("When the pull finished.", format="date-time"),
                            "references": _int(minimum=0),
                            "message": _str("Why the last pull failed (redacted)."),
                        },
                        required=("image", "state"),
                    ),
                    "Images the node store holds or pulls (ModelImageCache pre-pulls).",
                ),
                "evictionOrder": _list(_str(), "Next eviction candidates, first evicted first."),
                "revocations": _list(
                    _obj({"key": _str(), "reason": _str()}, required=("key",)),
                    "Revocation keys this agent applied to the node store.",
                ),
                "lastFailure": _obj(
                    {"time": _str(format="date-time"), "reason": _str(), "message": _str()}
                ),
                # peers (docs/peers.md): where this node serves its blobs, which it holds
                "peer": _obj(
                    {
                        "url": _str("The agent's peer blob server (token from a Secret)."),
                        "blobs": _list(_str(), "sha256 of the blobs of held revisions."),
                        "filling": _list(
                            _obj(
                                {
                                    "blob": _str("sha256 of a blob this node is filling."),
                                    "pieces": _int(minimum=1),
                                    "landed": _int("Pieces landed and verified.", minimum=0),
                                    "verified": _str("Those pieces' indices, e.g. 0-11,13."),
                                },
                                required=("blob",),
                            ),
                            "Fill progress peers follow (bounded; written at most every second).",
                        ),
                    }
                ),
                "warmups": _list(
                    _obj(
                        {
                            "revision": _str(),
                            "mode": _str(enum=["origin", "peer", "cache"]),
                            "seconds": _num(minimum=0),
                            "bytesFrom": _obj(
                                {
                                    "origin": _int(minimum=0),
                                    "peer": _int(minimum=0),
                                    "cache": _int(minimum=0),
                                }
                            ),
                        },
                        required=("revision", "mode"),
                    ),
                    "The last finished warm-ups and where their bytes came from.",
                ),
            }
        ),
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
        _obj(
            {
                "key": _str(
                    "A model revision, snapshot manifest digest, or image/blob digest "
                    "(sha256:<hex>)."
                ),
                "reason": _str("Why (shown in Events, status and pull errors)."),
            },
            required=("key",),
        ),
        _status({"appliedNodes": _list(_str(), "Nodes whose agent applied it to the store.")}),
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
