"""Image pre-pull for the local fleet (``modelCacheConfig.image.enabled``; docs/images.md).

With the key on, every reconcile step (``sync``) makes sure each target node (the
nodes ``modelCacheConfig.weights.nodes`` selects, all nodes by default) has a pull of
the image each variant runs (``running_images``: its ``image``, or while that is
revoked the ``image.fallback`` it rolled to; a fallback nothing runs is not pulled) into its store (``images.ImageCache``) done or under way: one
background task per (node, image), beside the weight warm-ups and never waited for by
the planner or the cache gate. A failed pull is retried with the warm-ups' backoff.

Once pulled, the endpoint holds a reference on the image on that node
(``ImageCache.ref``), so no eviction takes it while the endpoint uses it; an image no
variant or live replica uses any more is unreferenced (``unref``: the last reference
removes it); when the fleet stops, every reference is dropped but the images stay in the
node stores, unreferenced, for the eviction policy (the next ``preheat up`` finds them).

A replica that starts before its node has the image pulls it itself
(``for_replica``): local mode has no container runtime, so the start's ``image`` stage
is the pull into the node store (sharing a pre-pull already running there). The
outcome is ``cache`` (the node held it when the replica started) or ``pull``; a pull
that fails or takes longer than ``IMAGE_WAIT`` never fails the start: the record says
``pull`` with no ``image_ready``, the reason in the fleet log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass

from preheat.artifacts.refs import redact_url
from preheat.config import format_size
from preheat.errors import PreheatError
from preheat.images.cache import ImageCache
from preheat.images.reference import parse_image_ref
from preheat.runtime.model import FleetState, Node, Replica

__all__ = ["IMAGE_WAIT", "ImageOutcome", "ImageWarmer"]

#: Seconds a replica start waits for its image before it goes on without it.
IMAGE_WAIT = 60.0
_BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0)


@dataclass(frozen=True)
class ImageOutcome:
    """A replica start's image stage: ``cache`` or ``pull``; ``ready`` (wall clock) is
    None when the pull failed (``error`` says why)."""

    source: str
    ready: float | None
    error: str | None = None


@dataclass
class _Entry:
    """One image on one node: the pull under way, the digest once referenced."""

    task: asyncio.Task[None] | None = None
    digest: str | None = None
    failures: int = 0
    retry_at: float = 0.0
    error: str | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class ImageWarmer:
    """Pre-pulls and references the endpoint's images on the fleet's nodes."""

    def __init__(self, state: FleetState) -> None:
        self.state = state
        self.entries: dict[tuple[str, str], _Entry] = {}
        self._caches: dict[str, ImageCache] = {}

    @property
    def enabled(self) -> bool:
        return self.state.spec.cache.image.enabled

    def image_of(self, r: Replica) -> str | None:
        """The image ``r`` runs (its template's), when image caching is on."""
        if not self.enabled:
            return None
        st = self.state
        if r.template in st.templates:
            return st.templates[r.template][1]
        return st.spec.variant(r.variant).image

    def holds(self, node: str, image: str) -> bool:
        e = self.entries.get((node, image))
        return e is not None and e.digest is not None

    def _cache(self, node: Node) -> ImageCache:
        cache = self._caches.get(node.name)
        if cache is None or cache.store is not node.cache.store:
            cache = self._caches[node.name] = ImageCache(node.cache.store)
        return cache

    def running_images(self) -> list[str]:
        """The image each variant runs: its ``image``, or, while that is revoked, its
        first ``image.fallback`` that is not (resolved on the revocation); none while
        every one is revoked (a pull would be refused). What the pre-pull covers."""
        st = self.state
        out: set[str] = set()
        for v in st.spec.variants:
            if not v.image:
                continue
            if not self.revoked(v.image):
                out.add(v.image)
                continue
            for ref, digests in st.image_fallbacks.get(v.name, ()):
                if digests and not st.revoked_keys.intersection(digests):
                    out.add(ref)
                    break
        return sorted(out)

    def _wanted(self) -> set[str]:
        st = self.state
        wanted = set(self.running_images()) if self.enabled else set()
        for r in st.live_replicas():
            image = self.image_of(r)
            if image:
                wanted.add(image)
        return wanted

    # --- reconcile --------------------------------------------------------------------

    async def sync(self) -> None:
        """Start the pre-pulls that are due; unreference images nothing uses any more."""
        st = self.state
        if self.enabled:
            selector = st.spec.cache.weights.nodes
            images = self.running_images()
            for node in st.nodes.values():
                if not node.up or node.cache.closed:
                    continue
                if not selector.matches(node.name, node.spec.label_map):
                    continue
                for image in images:
                    e = self.entries.setdefault((node.name, image), _Entry())
                    if e.digest is None and not e.running and st.clock.now() >= e.retry_at:
                        self._start(node, image, e)
        wanted = self._wanted()
        for (name, image), e in list(self.entries.items()):
            if image in wanted or e.running:
                continue
            await self._drop(name, image, e)

    def _start(self, node: Node, image: str, e: _Entry) -> None:
        task = asyncio.create_task(self._pull(node, image, e), name=f"image-{node.name}")
        e.task = self.state.log.watch(task, f"image pull on {node.name}")

    async def _pull(self, node: Node, image: str, e: _Entry) -> None:
        st = self.state
        shown = redact_url(image)
        try:
            res = await self._cache(node).apull(image, rate_limit=node.spec.origin_bandwidth)
            await asyncio.to_thread(self._cache(node).ref, res.digest, st.spec.name)
        except (PreheatError, OSError) as exc:
            e.error = redact_url(str(exc))
            delay = _BACKOFF[min(e.failures, len(_BACKOFF) - 1)]
            e.failures += 1
            e.retry_at = st.clock.now() + delay
            st.say(
                f"image pull of {shown} on {node.name} failed: {e.error}; retry in {delay:.0f} s"
            )
            return
        e.digest, e.error, e.failures = res.digest, None, 0
        st.image_digests[image] = tuple(dict.fromkeys((res.digest, res.top_digest)))
        st.say(
            f"image {shown} on {node.name}: {res.digest[:19]}, "
            f"{format_size(res.bytes_fetched)} fetched, {format_size(res.bytes_reused)} "
            f"reused, {res.seconds:.1f} s"
        )
        st.wake()

    async def _drop(self, name: str, image: str, e: _Entry, *, remove: bool = True) -> None:
        self.entries.pop((name, image), None)
        node = self.state.nodes.get(name)
        if e.digest is None or node is None or node.cache.closed:
            return
        try:
            removed = await asyncio.to_thread(
                functools.partial(
                    self._cache(node).unref, e.digest, self.state.spec.name, remove=remove
                )
            )
        except (PreheatError, OSError) as exc:
            self.state.say(f"could not drop image {redact_url(image)} on {name}: {exc}")
            return
        gone = "; removed (no other reference)" if removed else ""
        self.state.say(
            f"{self.state.spec.name} no longer references {redact_url(image)} on {name}{gone}"
        )

    # --- a replica start --------------------------------------------------------------

    async def for_replica(self, r: Replica, node: Node, image: str) -> ImageOutcome:
        """The image stage of ``r``'s start on ``node``: the node's copy, else a pull
        (sharing one under way) for at most ``IMAGE_WAIT`` seconds; never raises."""
        st = self.state
        e = self.entries.setdefault((node.name, image), _Entry())
        if e.digest is not None:
            return ImageOutcome("cache", st.clock.wall())
        held = await asyncio.to_thread(self._find, node, image)
        if held is not None:  # an earlier run or another endpoint pulled it
            with contextlib.suppress(PreheatError, OSError):
                await asyncio.to_thread(self._cache(node).ref, held, st.spec.name)
                e.digest = held
                return ImageOutcome("cache", st.clock.wall())
        r.detail = f"pulling image {redact_url(image)}"
        if not e.running:
            self._start(node, image, e)
        assert e.task is not None
        done, _ = await asyncio.wait({e.task}, timeout=IMAGE_WAIT)
        if not done:
            e.error = f"not pulled within {IMAGE_WAIT:.0f} s (the pull goes on)"
        if e.digest is not None:
            return ImageOutcome("pull", st.clock.wall())
        why = e.error or "the pull failed"
        st.say(f"{r.id} starts without image {redact_url(image)} on {node.name}: {why}")
        return ImageOutcome("pull", None, why)

    def _find(self, node: Node, image: str) -> str | None:
        try:
            ref = parse_image_ref(image)
            img = self._cache(node).find(ref.digest or image)
        except (PreheatError, OSError):
            return None
        self.state.image_digests[image] = tuple(dict.fromkeys((img.digest, img.top_digest)))
        return img.digest

    def revoked(self, image: str) -> bool:
        """Whether ``image``'s digest was on the revocation list at the last tick."""
        return bool(self.state.revoked_keys.intersection(self.state.image_digests.get(image, ())))

    async def digests(self, image: str) -> tuple[str, ...] | None:
        """The digests ``image`` names (``ImageCache.adigests``: a node's record, else the
        registry); remembered. None, said, when neither answers."""
        st = self.state
        if image in st.image_digests:
            return st.image_digests[image]
        nodes = [n for n in st.nodes.values() if not n.cache.closed]
        if not nodes:
            return None
        try:
            digests = await self._cache(nodes[0]).adigests(image)
        except (PreheatError, OSError) as exc:
            st.say(f"image {redact_url(image)} does not resolve ({redact_url(str(exc))})")
            return None
        st.image_digests[image] = digests
        return digests

    # --- lifecycle --------------------------------------------------------------------

    def cancel_node(self, node: Node) -> None:
        """A lost node's pulls stop (pulled again when it comes back)."""
        for (name, _), e in self.entries.items():
            if name == node.name and e.task is not None and not e.task.done():
                e.task.cancel()

    async def stop(self) -> None:
        """The fleet stops: stop the pulls and drop every reference the endpoint holds,
        keeping the images in the stores for the eviction policy."""
        tasks = [e.task for e in self.entries.values() if e.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for (name, image), e in list(self.entries.items()):
            await self._drop(name, image, e, remove=False)
