"""The agent writes containerd's mirror configuration (``preheat agent --containerd-hosts-dir``).

With the node mirror on (``--mirror-port``) and the host's ``/etc/containerd/certs.d``
mounted (``preheat k8s render`` does both), the agent keeps one ``<dir>/<registry
host>/hosts.toml`` per registry of the images its ModelImageCaches pre-pull on this node:
the content of :func:`preheat.runtime.kubernetes.mirror_config.hosts_toml` (the mirror
first, the registry itself as ``server``), so containerd pulls what the store holds from
the mirror and everything else from the registry as before.

* A file is written atomically (a temp file beside it, then ``os.replace``) and only when
  its content changes, so containerd never reads half a file and an unchanged node sees
  no write.
* The agent's files start with :data:`MARK`. A ``hosts.toml`` without it (the node's own
  configuration) is never overwritten or removed: the agent logs once and leaves it.
* When no image cache on the node needs a registry any more, the agent removes the file
  it wrote (and the directory, when empty). Nothing is removed before the agent has seen
  the full list of ModelImageCaches (no decision on a partial view).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from preheat.errors import PreheatError
from preheat.images.reference import parse_image_ref
from preheat.runtime.kubernetes.mirror_config import hosts_toml

__all__ = ["MARK", "ContainerdHosts", "HostsChange", "registries_of"]

log = logging.getLogger("preheat.agent")

MARK = "# Written by the preheat agent (node image mirror); removed when no image cache needs it.\n"
_FILE = "hosts.toml"


def registries_of(images: Iterable[str]) -> set[str]:
    """The registry hosts (``host[:port]``, or ``docker.io``) of ``images``; an image
    reference that does not parse names none (its pull reports the error)."""
    out = set()
    for image in images:
        try:
            out.add(parse_image_ref(image).registry)
        except PreheatError:
            continue
    return out


@dataclass(frozen=True)
class HostsChange:
    """What one :meth:`ContainerdHosts.sync` did (registry hosts)."""

    written: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()  # wanted, but the node's own file is there


@dataclass
class ContainerdHosts:
    """The ``hosts.toml`` files under ``root`` that send ``registries`` to ``mirror``."""

    root: Path
    mirror: str
    _warned: set[str] = field(default_factory=set)

    def body(self, registry: str) -> str:
        return MARK + hosts_toml(registry, self.mirror)

    def _ours(self, path: Path) -> bool:
        try:
            with path.open() as f:
                return f.readline() == MARK
        except OSError:
            return False

    def sync(self, registries: Iterable[str]) -> HostsChange:
        """Write the wanted files that differ, remove the agent's files no longer wanted."""
        want = sorted(set(registries))
        written, foreign = [], []
        for registry in want:
            path = self.root / registry / _FILE
            body = self.body(registry)
            if path.exists():
                if not self._ours(path):
                    foreign.append(registry)
                    if registry not in self._warned:
                        self._warned.add(registry)
                        log.warning("containerd %s is not the agent's: left as it is", path)
                    continue
                if path.read_text() == body:
                    continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{_FILE}.{os.getpid()}.tmp")
            tmp.write_text(body)
            os.replace(tmp, path)
            written.append(registry)
            log.info("wrote containerd %s (mirror %s)", path, self.mirror)
        removed = []
        for path in sorted(self.root.glob(f"*/{_FILE}")) if self.root.is_dir() else ():
            registry = path.parent.name
            if registry in want or not self._ours(path):
                continue
            path.unlink()
            with contextlib.suppress(OSError):  # not empty: the node's other files stay
                path.parent.rmdir()
            removed.append(registry)
            log.info("removed containerd %s (no image cache needs %s)", path, registry)
        return HostsChange(tuple(written), tuple(removed), tuple(foreign))
