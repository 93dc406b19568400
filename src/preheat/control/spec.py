"""The endpoint spec and the local cluster file: validated once at the edge, frozen inside.

This module is the public face of three others, one concept each:
``spec_types`` (the frozen values the pure planner uses), ``spec_schema`` (the pydantic
models, the conversion and its messages) and ``spec_files`` (reading YAML files, paths).

YAML (or a dict from an HTTP body) goes through pydantic models that reject unknown keys
and wrong types; the result is converted to frozen dataclasses that the planner and the
executor use. Every error is a ``ConfigError`` whose message names the endpoint (or the
cluster file), the field as the user wrote it, the bad value and the fix::

    endpoint 'chat': routing.prefix_length 100 is below 1024; use 1024..65536 characters

Endpoint shape (``camelCase`` and ``snake_case`` keys are both accepted)::

    name: chat
    model: {source: http://origin/llama/preheat-manifest.json, revision: <optional digest>}
    image: registry/vllm:0.6          # optional
    engine: {simulated: {profile: tiny, time_scale: 0.01}}
            # or {command: "vllm serve {snapshot} --port {port}"}
    replicas: {min: 2, max: 4}
    autoscaling: {target_in_flight: 8}   # optional: in-flight requests per replica
    variants:                            # optional; default: one variant named "main"
      - {name: a, weight: 90}
      - {name: b, weight: 10, model: {source: ...}}
    routing: {strategy: prefix_aware, prefix_length: 2048, concurrency_threshold: 8}
            # a field left out takes the router's default (PolicyParams: random, 8192, 64)
    modelCacheConfig:
      weights: {enabled: true, nodes: {selector: {gpu: "yes"}}, minReady: 2,
                priority: 10, pin: true, timeoutSeconds: 600}
      image: {enabled: false}

Cluster shape::

    origin: {bandwidth: 50MiB/s}        # default per-node limit on origin downloads
    nodes:
      - {name: node-a, store: nodes/a, capacity: 20GiB, labels: {gpu: "yes"}, slots: 2,
         origin_bandwidth: 40MiB/s}
"""

from __future__ import annotations

from preheat.control.spec_files import default_cluster, load_cluster, load_endpoint
from preheat.control.spec_schema import check_against_cluster, parse_cluster, parse_endpoint
from preheat.control.spec_types import (
    Autoscaling,
    ClusterSpec,
    CommandEngine,
    EndpointSpec,
    EngineSpec,
    ImageCacheSpec,
    ModelCacheConfig,
    ModelSpec,
    NodeSelector,
    NodeSpec,
    OriginSpec,
    PeerSpec,
    ReplicaRange,
    RoutingSpec,
    SimulatedEngine,
    VariantSpec,
    WeightsCacheSpec,
)

__all__ = [
    "Autoscaling",
    "ClusterSpec",
    "CommandEngine",
    "EndpointSpec",
    "EngineSpec",
    "ImageCacheSpec",
    "ModelCacheConfig",
    "ModelSpec",
    "NodeSelector",
    "NodeSpec",
    "OriginSpec",
    "PeerSpec",
    "ReplicaRange",
    "RoutingSpec",
    "SimulatedEngine",
    "VariantSpec",
    "WeightsCacheSpec",
    "check_against_cluster",
    "default_cluster",
    "load_cluster",
    "load_endpoint",
    "parse_cluster",
    "parse_endpoint",
]
