"""Endpoint spec and cluster file validation: good input becomes frozen values, bad input a
ConfigError that names the field, the value and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from preheat.control.spec import (
    CommandEngine,
    SimulatedEngine,
    check_against_cluster,
    load_cluster,
    load_endpoint,
    parse_cluster,
    parse_endpoint,
)
from preheat.errors import ConfigError

FULL = """
name: chat
model: {source: "http://127.0.0.1:8080/m/preheat-manifest.json"}
image: registry.local/vllm:0.6
engine: {simulated: {profile: tiny, time_scale: 0.01}}
replicas: {min: 2, max: 4}
autoscaling: {targetInFlight: 8}
variants:
  - {name: a, weight: 90}
  - {name: b, weight: 10, model: {source: "file:///models/b"}, replicas: {min: 1}}
routing: {strategy: prefix_aware, prefix_length: 4096, concurrency_threshold: 8}
modelCacheConfig:
  weights: {enabled: true, nodes: {selector: {gpu: "yes"}}, minReady: 2, priority: 5,
            pin: true, timeoutSeconds: 30}
  image: {enabled: true}
"""


def _base(**extra: object) -> dict[str, object]:
    d: dict[str, object] = {"name": "chat", "model": {"source": "http://o/m"}}
    d.update(extra)
    return d


def _err(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse_endpoint(data)
    return str(info.value)


def test_full_spec_round_trip(tmp_path: Path) -> None:
    """A complete spec parses into frozen values with variant inheritance applied."""
    f = tmp_path / "endpoint.yaml"
    f.write_text(FULL)
    spec = load_endpoint(f)
    assert spec.name == "chat"
    a, b = spec.variants
    assert a.model.source.startswith("http://") and b.model.source == "file:///models/b"
    assert a.replicas.min == 2 and a.replicas.max == 4
    assert b.replicas.min == 1 and b.replicas.max == 1
    assert a.image == b.image == "registry.local/vllm:0.6"
    assert isinstance(a.engine, SimulatedEngine) and a.engine.time_scale == 0.01
    assert (a.weight, b.weight) == (90, 10)
    assert spec.routing.strategy == "prefix_aware" and spec.routing.prefix_length == 4096
    w = spec.cache.weights
    assert w.enabled and w.min_ready == 2 and w.pin and w.priority == 5
    assert w.nodes.matches("n1", {"gpu": "yes"}) and not w.nodes.matches("n2", {"gpu": "no"})
    assert spec.cache.image.enabled
    assert spec.autoscaling is not None and spec.autoscaling.scale_in_below == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_minimal_spec_defaults() -> None:
    """Only name and model: one 'main' variant, random routing, no cache gate."""
    spec = parse_endpoint(_base())
    (v,) = spec.variants
    assert v.name == "main" and v.replicas.min == v.replicas.max == 1
    assert spec.routing.strategy == "random"
    assert not spec.cache.weights.enabled


def test_command_engine_placeholders() -> None:
    """A command engine keeps its template; unknown placeholders or no {port} are refused."""
    spec = parse_endpoint(_base(engine={"command": "vllm serve {snapshot} --port {port}"}))
    assert spec.variants[0].engine == CommandEngine("vllm serve {snapshot} --port {port}")
    assert "{snap}" in _err(_base(engine={"command": "vllm serve {snap} --port {port}"}))
    assert "no {port}" in _err(_base(engine={"command": "vllm serve {snapshot}"}))
    assert "exactly one" in _err(_base(engine={}))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            _base(routing={"prefix_length": 100}),
            "endpoint 'chat': routing.prefix_length 100 is below 1024",
        ),
        (_base(routing={"prefix_length": 70000}), "routing.prefix_length 70000 is above 65536"),
        (_base(routing={"strategy": "roundrobin"}), "routing.strategy 'roundrobin' is unknown"),
        (_base(routing={"concurrency_threshold": 0}), "routing.concurrency_threshold 0"),
        (_base(replicas={"min": 3, "max": 2}), "replicas.max 2 is below replicas.min 3"),
        (_base(replicas={"min": "two"}), "replicas.min 'two'"),
        (_base(bogus=1), "bogus is not a known field"),
        ({"name": "chat"}, "variants[0].model is missing"),
        (_base(model={"source": "models/x"}), "model.source 'models/x' is not a source ref"),
        ({"name": "Chat_1", "model": {"source": "http://o/m"}}, "name 'Chat_1' is not a valid"),
        (
            _base(variants=[{"name": "a"}, {"name": "a"}]),
            "variants[1].name 'a' is used twice",
        ),
        (_base(variants=[{"name": "a", "weight": 0}]), "total weight of 0"),
        (
            _base(modelCacheConfig={"weights": {"nodes": ["n1", "n2"], "minReady": 3}}),
            "modelCacheConfig.weights.minReady 3 is above the 2 listed nodes",
        ),
        (
            _base(modelCacheConfig={"weights": {"nodes": {"selectr": {"a": "b"}}}}),
            "modelCacheConfig.weights.nodes.selectr is not a known field",
        ),
        (
            _base(autoscaling={"targetInFlight": 4, "scaleInBelow": 5}),
            "autoscaling.scale_in_below 5 is not below target_in_flight 4",
        ),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_spec_names_the_field(data: object, expected: str) -> None:
    """Each kind of bad input is refused with a message naming the field and the value."""
    assert expected in _err(data)


def test_pydantic_errors_do_not_repeat_union_noise() -> None:
    """A typo under a union field gives one line, not one per union member."""
    msg = _err(_base(modelCacheConfig={"weights": {"nodes": {"selectr": {"a": "b"}}}}))
    assert "valid list" not in msg
    assert msg.count("\n") == 0


CLUSTER = """
origin: {bandwidth: 50MiB/s}
nodes:
  - {name: node-a, store: stores/a, capacity: 2GiB, labels: {gpu: "yes"}, slots: 1}
  - {name: node-b, capacity: 500MB, origin_bandwidth: 10MB/s}
"""


def test_cluster_file(tmp_path: Path) -> None:
    """Stores are relative to the file, bandwidths parse with /s, defaults are applied."""
    f = tmp_path / "cluster.yaml"
    f.write_text(CLUSTER)
    c = load_cluster(f)
    a, b = c.nodes
    assert a.store == tmp_path / "stores" / "a" and a.capacity == 2 * 1024**3
    assert a.label_map == {"gpu": "yes"} and a.slots == 1
    assert a.origin_bandwidth == 50 * 1024**2
    assert b.store == tmp_path / "nodes" / "node-b" and b.origin_bandwidth == 10_000_000
    assert c.node("node-b") is b
    with pytest.raises(ConfigError, match="no node 'node-z'"):
        c.node("node-z")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"nodes": []}, "nodes is empty"),
        ({"nodes": [{"name": "a", "capacity": "lots"}]}, "nodes[0].capacity 'lots' is not a size"),
        ({"nodes": [{"name": "a"}, {"name": "a"}]}, "nodes[1].name 'a' is used twice"),
        ({"nodes": [{"name": "a", "slots": 0}]}, "nodes[0].slots 0 must be at least 1"),
        ({"nodes": [{"name": "a", "origin_bandwidth": "fast"}]}, "origin_bandwidth 'fast'"),
        ({"nodes": [{"name": "a", "disk": 1}]}, "nodes[0].disk is not a known field"),
    ],
)
def test_bad_cluster(tmp_path: Path, data: object, expected: str) -> None:
    """Bad cluster files are refused with the field named."""
    with pytest.raises(ConfigError) as info:
        parse_cluster(data, base_dir=tmp_path)
    assert expected in str(info.value)


def test_spec_checked_against_cluster(tmp_path: Path) -> None:
    """Listed cache nodes must exist, a selector must select, minReady must be reachable."""
    cluster = parse_cluster(
        {"nodes": [{"name": "a", "labels": {"gpu": "yes"}}, {"name": "b"}]}, base_dir=tmp_path
    )
    ok = parse_endpoint(
        _base(modelCacheConfig={"weights": {"nodes": {"selector": {"gpu": "yes"}}}})
    )
    check_against_cluster(ok, cluster)
    cases = [
        ({"nodes": ["a", "zz"]}, "names 'zz', which is not in the cluster"),
        ({"nodes": {"selector": {"gpu": "no"}}}, "selects no node (nodes with gpu=no)"),
        ({"minReady": 3}, "minReady 3 is above the 2 target nodes"),
    ]
    for weights, expected in cases:
        spec = parse_endpoint(_base(modelCacheConfig={"weights": weights}))
        with pytest.raises(ConfigError) as info:
            check_against_cluster(spec, cluster)
        assert expected in str(info.value)


def test_spec_module_reexports_the_split_modules() -> None:
    """``preheat.control.spec`` keeps every public name, as the very objects of the split."""
    from preheat.control import spec, spec_files, spec_schema, spec_types

    for name in spec.__all__:
        home = next(m for m in (spec_types, spec_schema, spec_files) if name in m.__all__)
        assert getattr(spec, name) is getattr(home, name), name
    assert set(spec.__all__) == {*spec_types.__all__, *spec_schema.__all__, *spec_files.__all__}


def test_routing_defaults_and_bounds_are_the_routers() -> None:
    """A spec that leaves routing out gets PolicyParams' defaults; it accepts exactly the
    strategies, prefix lengths and concurrency thresholds the router accepts."""
    from preheat.router.policies import POLICIES, PolicyParams

    defaults = PolicyParams()
    for routing in ({}, {"routing": {}}):
        r = parse_endpoint(_base(**routing)).routing
        assert (r.strategy, r.prefix_length, r.concurrency_threshold) == (
            "random",
            defaults.prefix_length,
            defaults.concurrency_threshold,
        )
    for strategy in POLICIES:
        assert parse_endpoint(_base(routing={"strategy": strategy})).routing.strategy == strategy

    def router_accepts(**kw: int) -> bool:
        try:
            PolicyParams(**kw)  # type: ignore[arg-type]
        except ConfigError:
            return False
        return True

    def spec_accepts(**kw: int) -> bool:
        try:
            parse_endpoint(_base(routing=kw))
        except ConfigError:
            return False
        return True

    for field, edges in (
        ("prefix_length", (1023, 1024, 65536, 65537)),
        ("concurrency_threshold", (0, 1, 1024, 1025)),
    ):
        for value in edges:
            assert spec_accepts(**{field: value}) == router_accepts(**{field: value}), (
                field,
                value,
            )


def test_examples_set_their_routing_explicitly() -> None:
    """The shipped examples name prefix_length and concurrency_threshold, so a change of
    the defaults never changes how they route."""
    root = Path(__file__).resolve().parents[2] / "examples"
    for name in ("endpoint.yaml", "endpoint-v2.yaml"):
        r = load_endpoint(root / name).routing
        assert (r.strategy, r.prefix_length, r.concurrency_threshold) == ("prefix_aware", 2048, 8)
