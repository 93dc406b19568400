"""``InferenceEndpoint.spec``'s structural schema: the local-mode endpoint spec
(camelCase) plus pod overrides, as the CRD declares it.

Kubernetes 1.20 has no CEL validation rules, so this checks types, ranges and enums; the
cross-field checks stay in :mod:`preheat.control.spec` (the operator parses every spec
through it).
"""

from __future__ import annotations

from preheat.runtime.kubernetes.crd_schema import (
    Schema,
    array,
    boolean,
    free_form,
    integer,
    node_selector,
    number,
    obj,
    str_map,
    string,
)

__all__ = ["endpoint_spec_schema"]


def _model() -> Schema:
    return obj(
        {
            "source": string(
                "Artifact ref: file:///dir, http(s)://.../preheat-manifest.json, s3://bucket/prefix."
            ),
            "revision": string("Optional manifest digest the source must resolve to."),
            "fallback": array(
                obj(
                    {"source": string("Artifact ref."), "revision": string("Optional pin.")},
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
    return obj(
        {
            "simulated": obj(
                {
                    "profile": string("Timing profile (preheat engine serve --profile)."),
                    "timeScale": number(minimum=0),
                    "kvBlocks": integer(minimum=1),
                },
                "The built-in simulated engine.",
            ),
            "command": string(
                "Server command template with {snapshot}, {port}, {host}, {model}, {replica}; "
                "becomes the container's command and args."
            ),
        },
        "Exactly one of simulated or command.",
    )


def _replicas() -> Schema:
    return obj({"min": integer(minimum=0), "max": integer(minimum=1)}, "Replica bounds.")


def endpoint_spec_schema() -> Schema:
    """``InferenceEndpoint.spec``: the local-mode endpoint spec (camelCase) + pod overrides."""
    return obj(
        {
            "model": _model(),
            "image": _image(),
            "engine": _engine(),
            "replicas": _replicas(),
            "autoscaling": obj(
                {
                    "targetInFlight": number(minimum=0),
                    "scaleInBelow": number(minimum=0),
                    "cooldownSeconds": number(minimum=0),
                },
                "Scale on router-measured in-flight requests per replica.",
                required=("targetInFlight",),
            ),
            "variants": array(
                obj(
                    {
                        "name": string(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"),
                        "weight": number(minimum=0),
                        "model": _model(),
                        "image": _image(),
                        "engine": _engine(),
                        "replicas": _replicas(),
                    },
                    required=("name",),
                ),
                "Production variants; default: one variant named main.",
            ),
            "routing": obj(
                {
                    "strategy": string(enum=["random", "least_outstanding", "prefix_aware"]),
                    "prefixLength": integer(minimum=1024, maximum=65536),
                    "concurrencyThreshold": integer(minimum=1, maximum=1024),
                }
            ),
            "modelCacheConfig": obj(
                {
                    "weights": obj(
                        {
                            "enabled": boolean(),
                            "nodes": node_selector(),
                            "minReady": integer(
                                "Target nodes that must hold the revision first.", 0
                            ),
                            "priority": integer(),
                            "pin": boolean("Never evict this revision while it is wanted."),
                            "timeoutSeconds": number("Then deploy anyway, CacheReady=False.", 0),
                        }
                    ),
                    "image": obj({"enabled": boolean()}),
                }
            ),
            "pod": obj(
                {
                    "resources": free_form("Container resources (requests/limits)."),
                    "tolerations": array(free_form("A Toleration."), "Pod tolerations."),
                    "nodeSelector": str_map(
                        "Required node labels (preheat's own affinity is preferred)."
                    ),
                    "serviceAccountName": string(),
                    "env": array(
                        free_form("An EnvVar (value or valueFrom)."),
                        "Environment of the snapshot init container and the engine.",
                    ),
                },
                "Overrides for the pod template of the endpoint's Deployment.",
            ),
        },
        required=("model",),
    )
