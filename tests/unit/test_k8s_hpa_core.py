"""The External metrics API's pure parts and the adapter's rendered manifests."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.control.spec import parse_endpoint
from preheat.errors import ConfigError
from preheat.runtime.kubernetes.autoscaler import IN_FLIGHT_METRIC
from preheat.runtime.kubernetes.metrics_adapter import FrontProxy
from preheat.runtime.kubernetes.metrics_adapter_core import (
    api_resource_list,
    format_quantity,
    in_flight_by_variant,
    parse_selector,
    pinned,
    router_service_name,
    selector_matches,
    value_list,
)
from preheat.runtime.kubernetes.render import endpoint_manifests, system_manifests
from preheat.runtime.kubernetes.render_adapter import ADAPTER_RULES, HPA_READER_RULES


def _spec() -> object:
    return parse_endpoint(
        {
            "name": "chat",
            "model": {"source": "file:///m"},
            "replicas": {"min": 1, "max": 4},
            "autoscaling": {"targetInFlight": 2},
        },
        origin="test",
    )


def test_selectors_parse_as_the_api_server_writes_them() -> None:
    """Equality, inequality, set and existence terms parse and match like Kubernetes'."""
    reqs = parse_selector("endpoint=chat,variant in (main, canary),tier!=gpu,zone,!legacy")
    assert pinned(reqs, "endpoint") == "chat" and pinned(reqs, "variant") is None
    assert selector_matches(reqs, {"endpoint": "chat", "variant": "canary", "zone": "a"})
    assert not selector_matches(reqs, {"endpoint": "chat", "variant": "main"})  # no zone
    assert not selector_matches(reqs, {"endpoint": "chat", "variant": "main", "zone": "a",
                                       "legacy": "1"})  # fmt: skip
    assert not selector_matches(reqs, {"endpoint": "x", "variant": "main", "zone": "a"})
    assert parse_selector("") == ()
    assert pinned(parse_selector("endpoint==chat"), "endpoint") == "chat"


def test_a_selector_that_does_not_parse_names_the_term_and_the_grammar() -> None:
    """A malformed term raises ConfigError quoting it and listing what parses."""
    with pytest.raises(ConfigError, match=r"'variant in main'.*key in \(a,b\)"):
        parse_selector("endpoint=chat,variant in main")


def test_in_flight_sums_instances_per_variant_and_values_are_quantities() -> None:
    """Samples from several routers and instances add up per variant; the list carries
    the labels, an RFC 3339 timestamp and Kubernetes quantities."""
    samples = [({"variant": "main", "instance": "a"}, 2.0),
               ({"variant": "main", "instance": "b"}, 3.0),
               ({"variant": "canary", "instance": "c"}, 1.0), ({"instance": "x"}, 9.0)]  # fmt: skip
    assert in_flight_by_variant(samples) == {"main": 5.0, "canary": 1.0}
    body = value_list(IN_FLIGHT_METRIC, [({"endpoint": "chat", "variant": "main"}, 5.0)],
                      timestamp="2026-01-01T00:00:00Z")  # fmt: skip
    assert body["kind"] == "ExternalMetricValueList"
    assert body["apiVersion"] == "external.metrics.k8s.io/v1beta1"
    assert body["items"] == [{"metricName": IN_FLIGHT_METRIC, "value": "5",
                              "metricLabels": {"endpoint": "chat", "variant": "main"},
                              "timestamp": "2026-01-01T00:00:00Z"}]  # fmt: skip
    assert (format_quantity(0), format_quantity(2.5), format_quantity(0.0011)) == (
        "0",
        "2500m",
        "2m",
    )
    (res,) = api_resource_list()["resources"]
    assert res["name"] == IN_FLIGHT_METRIC and res["namespaced"] and res["verbs"] == ["get"]


def test_the_rendered_hpa_pins_the_endpoint_and_its_router_is_where_the_adapter_looks() -> None:
    """The HPA's metric selector names endpoint and variant (the adapter needs the
    endpoint), and the rendered router Service has the name the adapter reads."""
    objs = endpoint_manifests(_spec())  # type: ignore[arg-type]
    (hpa,) = [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    metric = hpa["spec"]["metrics"][0]["external"]["metric"]
    assert metric["name"] == IN_FLIGHT_METRIC
    assert metric["selector"]["matchLabels"] == {"endpoint": "chat", "variant": "main"}
    services = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    assert router_service_name("chat") in services


def test_adapter_manifests_are_least_privilege_and_register_the_api() -> None:
    """The adapter may list EndpointSlices and create SubjectAccessReviews only (no
    TokenReviews, no auth-delegator), reads the front-proxy CA through the built-in Role,
    the HPA controller may list only preheat's metric, and the APIService points at the
    adapter's Service; metrics_adapter=False leaves all of it out."""
    objs = system_manifests()
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert by["ClusterRole", "preheat-metrics-adapter"]["rules"] == list(ADAPTER_RULES)
    assert [r["verbs"] for r in ADAPTER_RULES] == [["list"], ["create"]]
    assert all("tokenreviews" not in r["resources"] for r in ADAPTER_RULES)
    reader = by["RoleBinding", "preheat-metrics-adapter-auth-reader"]
    assert reader["metadata"]["namespace"] == "kube-system"
    assert reader["roleRef"]["name"] == "extension-apiserver-authentication-reader"
    hpa = by["ClusterRoleBinding", "preheat-hpa-external-metrics"]
    assert hpa["subjects"] == [{"kind": "ServiceAccount", "name": "horizontal-pod-autoscaler",
                                "namespace": "kube-system"}]  # fmt: skip
    assert HPA_READER_RULES[0]["resources"] == [IN_FLIGHT_METRIC]
    assert HPA_READER_RULES[0]["verbs"] == ["list"]
    api = by["APIService", "v1beta1.external.metrics.k8s.io"]["spec"]
    assert api["service"] == {"name": "preheat-metrics-adapter", "namespace": "preheat-system",
                              "port": 443}  # fmt: skip
    assert api["insecureSkipTLSVerify"] is True and "caBundle" not in api
    assert not [o for o in system_manifests(metrics_adapter=False) if "adapter" in str(o)]


def test_front_proxy_identity_needs_an_allowed_client_certificate() -> None:
    """No client certificate, or one outside requestheader-allowed-names, is refused with
    the reason; an allowed one yields the X-Remote user, groups and extra."""
    from multidict import CIMultiDict

    fp = FrontProxy.from_configmap({
        "requestheader-client-ca-file": "PEM",
        "requestheader-allowed-names": '["front-proxy-client"]',
        "requestheader-username-headers": '["X-Remote-User"]',
        "requestheader-group-headers": '["X-Remote-Group"]',
        "requestheader-extra-headers-prefix": '["X-Remote-Extra-"]',
    })  # fmt: skip
    headers = CIMultiDict([("X-Remote-User", "alice"), ("X-Remote-Group", "a"),
                           ("X-Remote-Group", "b"), ("X-Remote-Extra-Scopes%2Fx", "s")])  # fmt: skip
    cert = {"subject": ((("commonName", "front-proxy-client"),),)}
    other = {"subject": ((("commonName", "mallory"),),)}
    assert "no front-proxy client certificate" in str(fp.identity(None, headers))
    assert "not among requestheader-allowed-names" in str(fp.identity(other, headers))
    assert fp.identity(cert, headers) == ("alice", ["a", "b"], {"scopes/x": ["s"]})
    with pytest.raises(ConfigError, match="--requestheader-client-ca-file"):
        FrontProxy.from_configmap({})


def test_the_adapter_cli_names_an_unreachable_api_server_without_a_traceback(
    tmp_path: Path,
) -> None:
    """`preheat metrics-adapter` with a kubeconfig whose server refuses connections exits 2
    naming the server and what to check, before it listens."""
    conf = tmp_path / "kubeconfig"
    conf.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', "
        "insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: x}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    res = CliRunner().invoke(
        main, ["metrics-adapter", "--kubeconfig", str(conf), "--cert-dir", str(tmp_path / "c")]
    )
    assert res.exit_code == 2, res.output
    assert "cannot reach the Kubernetes API server https://127.0.0.1:1" in res.output
    assert "Traceback" not in res.output
    assert (tmp_path / "c" / "tls.crt").is_file() and (
        tmp_path / "c" / "tls.key"
    ).stat().st_mode & 0o077 == 0
