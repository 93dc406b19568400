"""Serving images on the simulated nodes: which node holds which, and the pulls in flight.

Pure. Each model may name an image with a size (``image``, ``image_size`` in the models
file); models can share one. A node keeps every image it pulled (the container
runtime's image store, on the root disk, not the NVMe model store; kubelet's image
garbage collection is not modelled), so a start finds its image ``cache`` or ``pull``\\ s
it from the registry, whose bandwidth (``--registry-bandwidth``) all pulls share max-min
fairly as downloads share the origin's (``coldstart_flows``). Starts on one node that
need the same image wait for one pull. A node that joins later (a spot replacement)
holds no image; a node that is lost takes its pulls with it. Cache policies that warm
weights (``warm-all``, ``priority`` pins, ``predictive``) also pre-pull the image on the
node they warm, as ``modelCacheConfig.image`` does; the others pull at a start only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from preheat.sim.coldstart_flows import REGISTRY, Network

__all__ = ["ImagePull", "Images"]


@dataclass
class ImagePull:
    node: str
    image: str
    transfer: int
    #: Replicas whose runtime waits for this image.
    waiters: list[str] = field(default_factory=list)


class Images:
    """Images held per node and the pulls in flight (see the module docstring)."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self.held: dict[str, set[str]] = {}
        self.pulls: dict[tuple[str, str], ImagePull] = {}
        self.by_transfer: dict[int, ImagePull] = {}
        self.pulled = 0

    def holds(self, node: str, image: str) -> bool:
        return image in self.held.get(node, ())

    def pull(self, node: str, image: str, size: int, waiter: str | None = None) -> ImagePull:
        """Join the node's pull of ``image`` or start one from the registry."""
        p = self.pulls.get((node, image))
        if p is None:
            t = self.net.start(node, f"image:{image}", REGISTRY, size)
            p = ImagePull(node, image, t.id)
            self.pulls[(node, image)] = p
            self.by_transfer[t.id] = p
            self.pulled += 1
        if waiter is not None:
            p.waiters.append(waiter)
        return p

    def done(self, tid: int) -> ImagePull | None:
        """The pull of transfer ``tid`` finished: the node holds the image now."""
        p = self.by_transfer.pop(tid, None)
        if p is None:
            return None
        self.net.remove(tid)
        del self.pulls[(p.node, p.image)]
        self.held.setdefault(p.node, set()).add(p.image)
        return p

    def forget(self, replica: str) -> None:
        for p in self.pulls.values():
            if replica in p.waiters:
                p.waiters.remove(replica)

    def lose(self, node: str) -> None:
        """The node went away with its image store and its pulls."""
        self.held.pop(node, None)
        for key in [k for k in self.pulls if k[0] == node]:
            p = self.pulls.pop(key)
            self.by_transfer.pop(p.transfer, None)
            self.net.remove(p.transfer)
