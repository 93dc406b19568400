"""Image references and platforms (pure: no I/O).

``[HOST[:PORT]/]REPO[:TAG][@sha256:HEX]`` as docker and containerd read it: the first
component is a registry host when it has a ``.`` or ``:`` or is ``localhost``; otherwise
the image is on Docker Hub (``docker.io``, one-component names under ``library/``). A
reference with a digest is immutable; a tag is a pointer the client resolves once per
pull (the store records when). Plain HTTP is used only for loopback registries
(``localhost``, ``127.0.0.0/8``, ``[::1]``), as containerd and oras do; every other
registry is HTTPS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from preheat.errors import ConfigError

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?$")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: ``registry`` (host[:port]), ``repository``, and a
    ``tag`` and/or ``digest`` (``tag`` is ``latest`` when neither was written)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest when known, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def name(self) -> str:
        """``registry/repository`` (what the cache lists an image under)."""
        return f"{self.registry}/{self.repository}"

    @property
    def text(self) -> str:
        out = self.name
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def plain_http(self) -> bool:
        host = self.registry.rsplit(":", 1)[0] if "]" not in self.registry else self.registry
        host = host.split("]")[0].lstrip("[")
        return (
            host == "localhost"
            or host == "::1"
            or re.fullmatch(r"127(\.\d{1,3}){3}", host) is not None
        )

    @property
    def base_url(self) -> str:
        """``http(s)://HOST/v2``."""
        return f"{'http' if self.plain_http else 'https'}://{self.api_host}/v2"

    def with_digest(self, digest: str) -> ImageRef:
        return ImageRef(self.registry, self.repository, self.tag, digest)


def parse_image_ref(text: str) -> ImageRef:
    """Parse an image reference; the error names the bad part and shows valid forms."""
    example = "write e.g. 127.0.0.1:5000/team/app:v1 or registry.example/app@sha256:<64 hex>"
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"image reference {text!r} is empty; {example}")
    raw = text.strip()
    for prefix in ("docker://", "oci://"):
        raw = raw.removeprefix(prefix)
    digest = None
    if "@" in raw:
        raw, digest = raw.split("@", 1)
        if not _DIGEST.match(digest):
            raise ConfigError(
                f"image reference {text!r}: digest {digest!r} is not sha256:<64 lowercase hex>"
            )
    first, _, rest = raw.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, path = first, rest
        if not _HOST.match(registry):
            raise ConfigError(f"image reference {text!r}: {registry!r} is not a registry host")
    else:
        registry, path = DOCKER_HUB, raw
    tag = None
    slash = path.rfind("/")
    if ":" in path[slash + 1 :]:
        path, tag = path.rsplit(":", 1)
        if not _TAG.match(tag):
            raise ConfigError(
                f"image reference {text!r}: tag {tag!r} is invalid (letters, digits, '_', '.', "
                "'-', at most 128, not starting with '.' or '-')"
            )
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not _REPO.match(path):
        raise ConfigError(
            f"image reference {text!r}: repository {path!r} is invalid (lowercase components "
            f"separated by '/'); {example}"
        )
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(registry, path, tag, digest)


@dataclass(frozen=True)
class Platform:
    """``os/architecture[/variant]`` as in an image index's ``platform`` field."""

    os: str
    architecture: str
    variant: str | None = None

    @property
    def text(self) -> str:
        return "/".join(x for x in (self.os, self.architecture, self.variant) if x)

    def matches(self, entry: dict[str, object]) -> bool:
        """Whether an index entry's ``platform`` object is this platform. Without a
        variant here any variant matches (``linux/arm64`` takes ``linux/arm64/v8``)."""
        if entry.get("os") != self.os or entry.get("architecture") != self.architecture:
            return False
        return self.variant is None or entry.get("variant") == self.variant


_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm"}


def parse_platform(text: str) -> Platform:
    """``linux/amd64``, ``linux/arm64/v8``: the error names the bad value."""
    parts = text.strip().split("/") if isinstance(text, str) else []
    if len(parts) not in (2, 3) or not all(re.fullmatch(r"[a-z0-9_]+", p) for p in parts):
        raise ConfigError(
            f"platform {text!r} is not os/architecture[/variant]; write e.g. linux/amd64"
        )
    return Platform(parts[0], parts[1], parts[2] if len(parts) == 3 else None)


def node_platform(system: str, machine: str) -> Platform:
    """The platform of a node from ``platform.system()`` and ``platform.machine()``."""
    arch = _ARCH.get(machine.lower(), machine.lower())
    variant = "v7" if machine.lower() == "armv7l" else None
    return Platform(system.lower(), arch, variant)
