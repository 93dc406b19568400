"""containerd hosts.toml rendering for the node image mirror."""

from __future__ import annotations

import tomllib

import pytest

from preheat.errors import ConfigError
from preheat.runtime.kubernetes.mirror_config import hosts_path, hosts_toml, mirror_files


def test_hosts_toml_parses_and_points_at_the_mirror() -> None:
    """The rendered file is TOML with the upstream as server and the mirror as a pull host."""
    doc = tomllib.loads(hosts_toml("registry.example:5000", "http://127.0.0.1:5001"))
    assert doc["server"] == "https://registry.example:5000"
    assert doc["host"]["http://127.0.0.1:5001"]["capabilities"] == ["pull", "resolve"]


def test_docker_hub_and_loopback_servers() -> None:
    """docker.io maps to registry-1.docker.io; a loopback upstream is plain HTTP."""
    assert tomllib.loads(hosts_toml("docker.io", "http://127.0.0.1:5001"))["server"] == (
        "https://registry-1.docker.io"
    )
    assert tomllib.loads(hosts_toml("127.0.0.1:5000", "http://127.0.0.1:5001"))["server"] == (
        "http://127.0.0.1:5000"
    )
    assert hosts_path("docker.io") == "/etc/containerd/certs.d/docker.io/hosts.toml"
    assert list(mirror_files(["b:1", "a:2", "b:1"], "http://127.0.0.1:1")) == [
        "/etc/containerd/certs.d/a:2/hosts.toml",
        "/etc/containerd/certs.d/b:1/hosts.toml",
    ]


@pytest.mark.parametrize(
    ("registry", "mirror", "caps", "bad"),
    [
        ("bad host/x", "http://127.0.0.1:1", ("pull",), "bad host/x"),
        ("r.example", "127.0.0.1:1", ("pull",), "127.0.0.1:1"),
        ("r.example", "http://127.0.0.1:1", ("pull", "push"), "read-only"),
    ],
)
def test_bad_input_is_named(registry: str, mirror: str, caps: tuple[str, ...], bad: str) -> None:
    """A bad registry, mirror URL or a push capability is refused naming it."""
    with pytest.raises(ConfigError, match=bad):
        hosts_toml(registry, mirror, capabilities=caps)


def test_render_ships_the_hosts_files_in_a_configmap() -> None:
    """`preheat k8s render --containerd-mirror` adds a ConfigMap whose keys are valid
    ConfigMap keys, whose annotation maps each to containerd's path, and whose bodies are
    hosts_toml's; a bad registry is a usage error naming it."""
    import yaml
    from click.testing import CliRunner

    from preheat.cli import main
    from preheat.runtime.kubernetes.mirror_config import hosts_toml

    out = CliRunner().invoke(
        main, ["k8s", "render", "--crds", "--containerd-mirror", "registry.example:5000"]
    )
    assert out.exit_code == 0, out.output
    cms = [d for d in yaml.safe_load_all(out.output) if d and d["kind"] == "ConfigMap"]
    assert len(cms) == 1
    cm = cms[0]
    assert cm["metadata"]["namespace"] == "preheat-system"
    assert cm["data"] == {
        "registry.example_5000.hosts.toml": hosts_toml(
            "registry.example:5000", "http://127.0.0.1:5001"
        )
    }
    assert cm["metadata"]["annotations"]["preheat.dev/hosts-paths"] == (
        "registry.example_5000.hosts.toml=/etc/containerd/certs.d/registry.example:5000/hosts.toml"
    )
    bad = CliRunner().invoke(main, ["k8s", "render", "--containerd-mirror", "not a host"])
    assert bad.exit_code == 2 and "'not a host'" in bad.output
