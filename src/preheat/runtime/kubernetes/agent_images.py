"""The node agent's image pre-pulls: the ``ModelImageCache`` objects that target its node.

The agent watches ``ModelImageCache`` objects in every namespace (read-only, like
``ModelDataCache``). For each one whose ``spec.nodes`` selects its node it

1. pulls ``spec.image`` (``spec.digest`` when the operator pinned one) into the node store
   with ``ImageCache.apull``: the same store and fill path as the weights, so a layer two
   images share, or one a model shares, is stored once; one task per image, at most
   ``max_warmups`` at once, retried with capped exponential back-off while the registry
   fails; nothing ever waits for it (a pod that lands first pulls as usual);
2. resolves the tag once: the digest of the first pull is recorded (and kept in the store
   beside the image), later pulls of the image (after an eviction) go by ``name@digest``,
   and a restarted agent finds the image by ``name:tag`` in its store without asking the
   registry;
3. references the image for every endpoint in ``spec.endpoints`` (holder
   ``<namespace>/<endpoint>``, the image cache's ref leases: never evicted while
   referenced) and drops a reference once the endpoint leaves the list, the object goes
   or stops targeting the node; the image itself stays, unreferenced, for the eviction
   policy (local mode's ``preheat down`` does the same). Only holders with a ``/`` are the
   agent's: references an operator took by hand with ``preheat image ref`` are left alone;
4. reports every image in its ``NodeCache`` status (``status.images``: digest, bytes,
   ``Ready`` with ``readyAt``, ``Pulling``, ``Failed`` with the reason), through the
   status writer's extension hook (:func:`preheat.runtime.kubernetes.agent_images_status.image_rows`).

Nothing is released on a partial view: before the first list of ``ModelImageCache``
objects no reference is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from preheat.artifacts.refs import redact_url
from preheat.errors import PreheatError
from preheat.images.cache import ImageCache, ImageInfo
from preheat.images.reference import parse_image_ref
from preheat.runtime.kubernetes.agent_config import AgentConfig
from preheat.runtime.kubernetes.agent_images_status import (
    HeldImage,
    PendingImage,
    add_revision_ready_at,
    image_key,
    image_rows,
)
from preheat.runtime.kubernetes.agent_metrics import AgentMetrics
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_body import iso
from preheat.runtime.kubernetes.nodecache_status import targets_node
from preheat.store import NodeStore

__all__ = ["ImagePulls", "add_ready_at"]

log = logging.getLogger("preheat.agent")


@dataclass
class _Pull:
    """One wanted image on this node."""

    image: str  # as written in spec.image
    digest: str | None = None  # resolved once (or spec.digest)
    state: str = "Pulling"
    done: int = 0
    reason: str | None = None
    task: asyncio.Task[None] | None = None


@dataclass
class _Watched:
    objs: dict[str, dict[str, Any]] = field(default_factory=dict)
    synced: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class ImagePulls:
    """Pre-pulls, references and reports the images this node's ModelImageCaches name."""

    def __init__(
        self, cfg: AgentConfig, store: NodeStore, metrics: AgentMetrics, dirty: asyncio.Event
    ) -> None:
        self.cfg = cfg
        self.cache = ImageCache(store)
        self.watched = _Watched()
        self.pulls: dict[str, _Pull] = {}  # image key -> pull
        self._dirty = dirty
        self._sem = asyncio.Semaphore(cfg.max_warmups)
        r = metrics.telemetry.registry
        self.pulled = Counter("preheat_agent_image_pulls", "Image pre-pulls by outcome",
                              ["outcome"], registry=r)  # fmt: skip
        self.fetched = Counter("preheat_agent_image_bytes_fetched",
                               "Image bytes the agent fetched from registries", registry=r)  # fmt: skip

    # --- the watch (a thread) -------------------------------------------------------------

    def watch(self, custom: Any) -> tuple[str, Any, Any, dict[str, Any]]:
        """``(name, list_fn, apply, kwargs)`` of the ModelImageCache watch."""
        kw = {"group": GROUP, "version": VERSION, "plural": "modelimagecaches"}
        return "imagecaches", custom.list_cluster_custom_object, self.apply, kw

    def apply(self, kind: str | None, objs: list[dict[str, Any]]) -> None:
        with self.watched.lock:
            if kind is None:
                self.watched.objs = {}
                self.watched.synced = True
            for o in objs:
                key = f"{o['metadata']['namespace']}/{o['metadata']['name']}"
                if kind == "DELETED":
                    self.watched.objs.pop(key, None)
                else:
                    self.watched.objs[key] = o

    def wanted(self, node_labels: dict[str, str]) -> dict[str, tuple[str, str | None, set[str]]]:
        """image key -> (image, pinned digest, holders) of every cache targeting this node."""
        with self.watched.lock:
            objs = list(self.watched.objs.values())
        out: dict[str, tuple[str, str | None, set[str]]] = {}
        for o in objs:
            spec = o.get("spec") or {}
            image = spec.get("image")
            if not image or not targets_node(spec, self.cfg.node, node_labels):
                continue
            ns = o["metadata"]["namespace"]
            holders = {f"{ns}/{e}" for e in spec.get("endpoints") or ()}
            key = image_key(image)
            _, digest, prev = out.get(key, (image, None, set()))
            out[key] = (image, spec.get("digest") or digest, prev | holders)
        return out

    # --- pulls (the loop) ---------------------------------------------------------------

    def held(self, image: str, digest: str | None = None) -> ImageInfo | None:
        """The store's copy of ``image`` (by digest when known, else by ``name:tag``)."""
        try:
            ref = parse_image_ref(image)
            return self.cache.find(digest or ref.digest or f"{ref.name}:{ref.tag or 'latest'}")
        except (PreheatError, OSError):
            return None

    def ensure(self, node_labels: dict[str, str]) -> None:
        """One pull task per wanted image the store lacks; cancel those no longer wanted."""
        with self.watched.lock:
            if not self.watched.synced:
                return
        wanted = self.wanted(node_labels)
        for key, (image, digest, _) in wanted.items():
            p = self.pulls.get(key)
            if p is not None and p.task is not None and not p.task.done():
                continue
            if self.held(image, digest or (p.digest if p else None)) is not None:
                self.pulls.pop(key, None)
                continue
            p = p or _Pull(image, digest)
            p.task = asyncio.create_task(self._pull(key, p), name=f"image {key}")
            self.pulls[key] = p
        for key in set(self.pulls) - set(wanted):
            task = self.pulls.pop(key).task
            if task is not None:
                task.cancel()

    async def _pull(self, key: str, p: _Pull) -> None:
        delay = self.cfg.backoff_s
        while True:
            try:
                async with self._sem:
                    p.state, p.done = "Pulling", 0
                    self._dirty.set()

                    def progress(done: int, total: int) -> None:
                        p.done = done

                    ref = parse_image_ref(p.image)
                    by = f"{ref.name}@{p.digest}" if p.digest else p.image
                    res = await self.cache.apull(by, progress=progress)
                p.digest = p.digest or res.top_digest
                self.fetched.inc(res.bytes_fetched)
                self.pulled.labels("ok").inc()
                log.info("pulled image %s (%s): %d bytes fetched, %d reused",
                         redact_url(p.image), res.top_digest[:19], res.bytes_fetched,
                         res.bytes_reused)  # fmt: skip
                if self.pulls.get(key) is p:
                    del self.pulls[key]
                self._dirty.set()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is retried; the reason is reported
                self.pulled.labels("failed").inc()
                p.state, p.reason = "Failed", redact_url(f"{type(exc).__name__}: {exc}")
                log.warning("image pull of %s failed, retry in %.1f s: %s",
                            redact_url(p.image), delay, p.reason)  # fmt: skip
                self._dirty.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.backoff_max_s)

    def cancel_all(self) -> None:
        for p in self.pulls.values():
            if p.task is not None:
                p.task.cancel()

    # --- references (a thread) ----------------------------------------------------------

    def sync_refs(self, node_labels: dict[str, str]) -> None:
        """Reference each held wanted image for its endpoints; drop the agent's other
        references (holders ``ns/endpoint``), keeping the images (never on a partial view)."""
        with self.watched.lock:
            if not self.watched.synced:
                return
        want: dict[str, set[str]] = {}
        for image, digest, holders in self.wanted(node_labels).values():
            info = self.held(image, digest)
            if info is not None:
                want.setdefault(info.digest, set()).update(holders)
        for info in self.cache.images():
            mine = {h for h in info.references if "/" in h}
            for holder in sorted(want.get(info.digest, set()) - mine):
                self.cache.ref(info.digest, holder)
                log.info("referenced image %s for %s", info.digest[:19], holder)
            for holder in sorted(mine - want.get(info.digest, set())):
                self.cache.unref(info.digest, holder, remove=False)
                log.info("dropped the reference of %s on image %s (image kept)",
                         holder, info.digest[:19])  # fmt: skip

    # --- status -------------------------------------------------------------------------

    def add_status(self, status: dict[str, Any]) -> None:
        """The status writer's hook: ``status.images`` from the store and the pulls."""
        images = self.cache.images()
        held = [
            HeldImage(i.name, i.tag, i.top_digest, i.size, iso(i.pulled), len(i.references))
            for i in images
        ]
        # an image is a store snapshot too: listed here, not among the model revisions
        snaps = {i.snapshot.removeprefix("sha256:") for i in images}
        views = {
            s.revisions[-1] if s.revisions else f"sha256:{s.digest}"
            for s in self.cache.store.snapshots()
            if s.digest.removeprefix("sha256:") in snaps
        }
        revisions = [r for r in status.get("revisions") or () if r.get("revision") not in views]
        status["revisions"] = revisions
        status["revisionCount"] = sum(1 for r in revisions if r.get("state") == "Ready")
        pending = [
            PendingImage(
                p.image, p.state, p.done, p.reason if p.state == "Failed" else None, p.digest
            )
            for p in list(self.pulls.values())
        ]
        status["images"] = image_rows(held, pending)


def add_ready_at(store: NodeStore) -> Callable[[dict[str, Any]], None]:
    """A status hook: ``readyAt`` on each ``Ready`` revision (its snapshot's publish time)."""

    def extend(status: dict[str, Any]) -> None:
        at = {
            (i.revisions[-1] if i.revisions else f"sha256:{i.digest}"): iso(i.created)
            for i in store.snapshots()
        }
        add_revision_ready_at(status, at)

    return extend
