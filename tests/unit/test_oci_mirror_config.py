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
