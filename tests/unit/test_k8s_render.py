"""Kubernetes-mode manifests rendered from Python: CRDs, conversion, RBAC, kustomize base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from preheat.cli import main
from preheat.control.spec import parse_endpoint
from preheat.errors import ConfigError
from preheat.runtime.kubernetes.crd_endpoint import endpoint_spec_schema
from preheat.runtime.kubernetes.crds import custom_resource_definitions
from preheat.runtime.kubernetes.render import AGENT_PEER_RULES, AGENT_RULES, ROUTER_RULES, render
from preheat.runtime.kubernetes.resources import (
    endpoint_from_object,
    endpoint_object,
    load_endpoint_file,
)
from preheat.testing.kubelet import expand

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "endpoint.yaml"

TWO_VARIANTS = {
    "name": "code",
    "model": {
        "source": "s3://models/coder",
        "revision": "sha256:" + "a" * 64,
        "fallback": [{"source": "s3://models/coder-prev", "revision": "sha256:" + "b" * 64}],
    },
    "image": "registry.local/vllm:0.6",
    "engine": {"command": "vllm serve {snapshot} --port {port} --served-model-name {model}"},
    "replicas": {"min": 1, "max": 3},
    "autoscaling": {"target_in_flight": 6},
    "variants": [
        {"name": "a", "weight": 90},
        {"name": "b", "weight": 10, "engine": {"simulated": {"profile": "tiny", "kv_blocks": 64}}},
    ],
    "routing": {"strategy": "least_outstanding", "prefix_length": 4096},
    "modelCacheConfig": {"weights": {"nodes": ["n1", "n2"], "minReady": 1, "priority": 5}},
}


def _undeclared(value: Any, schema: dict[str, Any], where: str = "spec") -> list[str]:
    """Paths in ``value`` that the structural schema would prune."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        if "additionalProperties" in schema:
            return []
        props = schema.get("properties", {})
        out = []
        for k, v in value.items():
            if k not in props:
                out.append(f"{where}.{k}")
            else:
                out += _undeclared(v, props[k], f"{where}.{k}")
        return out
    if isinstance(value, list):
        return [
            p for i, v in enumerate(value) for p in _undeclared(v, schema["items"], f"{where}[{i}]")
        ]
    return []


@pytest.mark.parametrize("doc", ["example", "two_variants"])
def test_endpoint_object_round_trips_through_the_local_parser(doc: str) -> None:
    """An InferenceEndpoint made from a local-mode spec parses back to the same spec."""
    spec = load_endpoint_file(EXAMPLE)[0] if doc == "example" else parse_endpoint(TWO_VARIANTS)
    obj = endpoint_object(spec, namespace="team-a")
    back, pod = endpoint_from_object(obj)
    assert back == spec
    assert pod.to_dict() == {}
    assert obj["metadata"] == {
        "name": spec.name,
        "namespace": "team-a",
        "labels": {"app.kubernetes.io/part-of": "preheat"},
    }


def test_every_rendered_spec_field_is_declared_in_the_crd_schema(tmp_path: Path) -> None:
    """Nothing the renderer writes would be pruned by the API server (pod overrides included)."""
    f = tmp_path / "ep.yaml"
    doc = dict(TWO_VARIANTS)
    doc["pod"] = {
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"pool": "gpu"},
        "serviceAccountName": "inference",
    }
    f.write_text(yaml.safe_dump(doc))
    spec, pod = load_endpoint_file(f)
    obj = endpoint_object(spec, namespace="default", pod=pod)
    assert _undeclared(obj["spec"], endpoint_spec_schema()) == []
    assert obj["spec"]["pod"]["nodeSelector"] == {"pool": "gpu"}
    assert endpoint_from_object(obj)[1] == pod


def test_unknown_pod_override_is_rejected_with_the_fields_it_takes(tmp_path: Path) -> None:
    """A typo under pod: names the field and lists the four it accepts."""
    f = tmp_path / "ep.yaml"
    f.write_text(yaml.safe_dump({**TWO_VARIANTS, "pod": {"nodeSelecter": {"a": "b"}}}))
    with pytest.raises(ConfigError, match=r"pod\.nodeSelecter .*resources, tolerations"):
        load_endpoint_file(f)


def test_crds_are_structural_with_status_and_printer_columns() -> None:
    """Five v1 CRDs in preheat.dev/v1alpha1; each has a status subresource, printer
    columns, the four condition types, and the scope the design table gives it."""
    crds = {c["spec"]["names"]["kind"]: c for c in custom_resource_definitions()}
    assert set(crds) == {
        "InferenceEndpoint", "ModelDataCache", "ModelImageCache", "NodeCache", "Revocation"
    }  # fmt: skip
    scopes = {k: c["spec"]["scope"] for k, c in crds.items()}
    assert scopes["NodeCache"] == "Cluster" and scopes["InferenceEndpoint"] == "Namespaced"
    assert scopes["Revocation"] == "Cluster"
    for crd in crds.values():
        (version,) = crd["spec"]["versions"]
        assert crd["spec"]["group"] == "preheat.dev" and version["name"] == "v1alpha1"
        assert version["subresources"] == {"status": {}}
        assert version["additionalPrinterColumns"][-1]["name"] == "Age"
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        kinds = status["conditions"]["items"]["properties"]["type"]["enum"]
        assert kinds == ["Ready", "CacheReady", "Progressing", "Degraded"]


def test_least_privilege_rules() -> None:
    """The agent cannot delete pods or write caches other than its NodeCache; the router only reads."""
    for rule in AGENT_RULES:
        if "pods" in rule["resources"]:
            assert rule["verbs"] == ["get", "list", "watch"]
        if "modeldatacaches" in rule["resources"]:
            assert set(rule["verbs"]) == {"get", "list", "watch"}
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in ROUTER_RULES)
    roles = [o for o in render(crds=False) if o["kind"] == "Role"]
    # the router's Role comes only with an endpoint; the agent's peer Role and the
    # operator's settings Role (k8swire: peers on?) are namespaced
    assert [r["metadata"]["name"] for r in roles] == [
        "preheat-operator-settings",
        "preheat-agent-peers",
    ]
    assert {r["metadata"]["namespace"] for r in roles} == {"preheat-system"}
    assert {res for r in AGENT_PEER_RULES for res in r["resources"]} == {"leases", "configmaps"}
    assert all("delete" not in r["verbs"] for r in AGENT_PEER_RULES)


def test_deploy_base_matches_the_renderer(tmp_path: Path) -> None:
    """deploy/base is exactly what `preheat k8s render --kustomize` writes (never stale)."""
    out = tmp_path / "base"
    result = CliRunner().invoke(main, ["k8s", "render", "--kustomize", str(out)])
    assert result.exit_code == 0, result.output
    base = ROOT / "deploy" / "base"
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(p.name for p in base.iterdir())
    for name in written:
        assert (base / name).read_text() == (out / name).read_text(), name


def test_render_cli_prints_endpoint_objects_and_reports_bad_files(tmp_path: Path) -> None:
    """-f adds the router and the InferenceEndpoint; a bad file exits 2 naming the field."""
    result = CliRunner().invoke(main, ["k8s", "render", "--crds", "-f", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    kinds = [d["kind"] for d in yaml.safe_load_all(result.output)]
    assert kinds.count("CustomResourceDefinition") == 5
    assert "DaemonSet" not in kinds  # --crds: no system part
    assert kinds[-1] == "InferenceEndpoint" and "Service" in kinds
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: chat\nmodel: {source: file:///m}\nrouting: {prefix_length: 10}\n")
    result = CliRunner().invoke(main, ["k8s", "render", "-f", str(bad)])
    assert result.exit_code == 2
    assert "routing.prefix_length 10 is below 1024" in result.output


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--host=$(POD_IP)", "--host=127.2.1.1"),
        ("$(MISSING) stays", "$(MISSING) stays"),
        ("$$(POD_IP) is escaped", "$(POD_IP) is escaped"),
        ("$(A)$(POD_IP)", "x127.2.1.1"),
    ],
)
def test_kubelet_standin_expands_variables_like_kubernetes(text: str, expected: str) -> None:
    """$(VAR) is replaced, unknown names stay as written, $$ escapes."""
    assert expand(text, {"POD_IP": "127.2.1.1", "A": "x"}) == expected
