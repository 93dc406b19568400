"""``ModelImageCache`` objects: one per image reference in a namespace, for the agents.

With ``modelCacheConfig.image.enabled`` an endpoint wants every variant's image (its
``image``, else the engine default) pre-pulled on its target nodes. The operator keeps one
``ModelImageCache`` per image reference and namespace, ``img-<12 hex of the ref>``, shared
by every endpoint that uses that image: ``spec.endpoints`` lists them (no owner reference:
one endpoint's deletion must not collect another's cache), ``spec.nodes`` are the weights
cache's target nodes. An endpoint that stops wanting an image (image changed, image cache
disabled, endpoint deleted) takes its name out; the last one out deletes the object.

This never gates a Deployment: it runs after the endpoint's pass, and a failure here is
logged by the loop, not fatal to the pass. Writes carry ``metadata.resourceVersion`` (a
concurrent edit by another endpoint's loop is a 409, retried on the next pass). Digest
resolution and the pulls are the node agents' (``agent_images``): each target node's agent
reports its images in its ``NodeCache`` status, and every pass of an endpoint that uses
the image aggregates those rows into the object's status (``status.nodes``,
``readyNodes``, ``digest``, conditions ``Ready``/``Degraded``; written only on change,
with an Event when ``Ready`` turns True or ``Degraded`` turns True).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from preheat.control.spec_types import EndpointSpec
from preheat.runtime.kubernetes.agent_images_status import image_cache_status
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.nodecache_status import targets_node
from preheat.runtime.kubernetes.workload import DEFAULT_IMAGE

__all__ = ["IMAGE_CACHES", "image_cache_name", "sync_image_caches", "wanted_images"]

IMAGE_CACHES = "modelimagecaches"
_COMPONENT = {"app.kubernetes.io/part-of": "preheat", "app.kubernetes.io/component": "image-cache"}
_MERGE = "application/merge-patch+json"


def image_cache_name(ref: str) -> str:
    return "img-" + hashlib.sha256(ref.encode()).hexdigest()[:12]


def wanted_images(spec: EndpointSpec | None) -> set[str]:
    """The image references ``spec`` wants pre-pulled (none when the image cache is off)."""
    if spec is None or not spec.cache.image.enabled:
        return set()
    return {v.image or DEFAULT_IMAGE for v in spec.variants}


def _nodes(spec: EndpointSpec | None) -> dict[str, Any]:
    if spec is None:
        return {}
    n = spec.cache.weights.nodes
    if n.names:
        return {"names": list(n.names)}
    return {"selector": dict(n.labels)} if n.labels else {}


async def sync_image_caches(
    custom: client.CustomObjectsApi,
    namespace: str,
    endpoint: str,
    spec: EndpointSpec | None,
    emit: Callable[[dict[str, Any], str, str], None] = lambda _o, _r, _m: None,
    attempt: int = 0,
) -> None:
    """Make the namespace's ``ModelImageCache`` objects list ``endpoint`` exactly for the
    images ``spec`` wants (``None``: the endpoint is gone); ``emit(obj, reason, message)``.
    A write that loses a race (409) is retried on the next pass, or at once (up to 10
    times, ``attempt``) when the endpoint is gone: two endpoints deleted together must
    both leave the list, and the last one out must delete the object."""
    wanted = wanted_images(spec)
    sel = ",".join(f"{k}={v}" for k, v in _COMPONENT.items())
    listed: Any = await asyncio.to_thread(
        custom.list_namespaced_custom_object, GROUP, VERSION, namespace, IMAGE_CACHES,
        label_selector=sel,
    )  # fmt: skip
    existing = {o["spec"]["image"]: o for o in listed.get("items") or ()}
    for ref in sorted(wanted - set(existing)):
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelImageCache",
            "metadata": {
                "name": image_cache_name(ref),
                "namespace": namespace,
                "labels": dict(_COMPONENT),
            },
            "spec": {"image": ref, "nodes": _nodes(spec), "endpoints": [endpoint]},
        }
        try:
            created: Any = await asyncio.to_thread(
                custom.create_namespaced_custom_object, GROUP, VERSION, namespace, IMAGE_CACHES,
                body,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
            continue  # another endpoint's loop made it: joined on the next pass
        emit(created, "ImageCacheCreated", f"ModelImageCache for {ref} (used by {endpoint})")
    for ref, obj in existing.items():
        users: list[str] = list(obj["spec"].get("endpoints") or ())
        want = ref in wanted
        if want == (endpoint in users):
            continue
        users = sorted({*users, endpoint}) if want else [u for u in users if u != endpoint]
        if not await _update(custom, namespace, obj, users):
            if spec is None and attempt < 10:  # a gone endpoint has no next pass: retry now
                await asyncio.sleep(0.2 * (attempt + 1))
                return await sync_image_caches(custom, namespace, endpoint, None, emit, attempt + 1)
            continue
        if not users:
            emit(obj, "ImageCacheDeleted", f"no endpoint uses {ref} any more")
    mine = [o for r, o in existing.items() if r in wanted]
    if mine:
        await asyncio.to_thread(_write_statuses, custom, mine, emit)


def _write_statuses(
    custom: client.CustomObjectsApi,
    objs: list[dict[str, Any]],
    emit: Callable[[dict[str, Any], str, str], None],
) -> None:
    """Aggregate the target nodes' NodeCache image rows into each object's status."""
    core = client.CoreV1Api(custom.api_client)
    listed: Any = core.list_node().items
    nodes = [(str(n.metadata.name), dict(n.metadata.labels or {})) for n in listed]
    caches: Any = custom.list_cluster_custom_object(GROUP, VERSION, "nodecaches")
    by_node = {str((c.get("spec") or {}).get("node") or c["metadata"]["name"]): c
               for c in caches.get("items") or ()}  # fmt: skip
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for obj in objs:
        spec, old = obj.get("spec") or {}, obj.get("status") or {}
        targets = [name for name, labels in nodes if targets_node(spec, name, labels)]
        status = image_cache_status(
            image=spec["image"], generation=int(obj["metadata"].get("generation") or 1),
            target_nodes=targets, nodecaches=by_node, now=now, previous=old,
        )  # fmt: skip
        if status == {k: old.get(k) for k in status}:
            continue
        try:
            custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, obj["metadata"]["namespace"], IMAGE_CACHES,
                obj["metadata"]["name"], {"status": status}, _content_type=_MERGE,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile by the last endpoint out
                raise
            continue
        before = {c["type"]: c.get("status") for c in old.get("conditions") or ()}
        for c in status["conditions"]:
            if c["status"] == "True" and before.get(c["type"]) != "True":
                reason = "ImageCacheReady" if c["type"] == "Ready" else "ImagePullFailed"
                emit(obj, reason, c.get("message") or f"{spec['image']} on every target node")


async def _update(
    custom: client.CustomObjectsApi, namespace: str, obj: dict[str, Any], users: Iterable[str]
) -> bool:
    """Write ``users`` (none: delete) at the listed resourceVersion; False on a 409."""
    name, users = obj["metadata"]["name"], list(users)
    try:
        if users:
            patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                     "spec": {"endpoints": users}}  # fmt: skip
            await asyncio.to_thread(
                custom.patch_namespaced_custom_object, GROUP, VERSION, namespace, IMAGE_CACHES,
                name, patch, _content_type=_MERGE,
            )  # fmt: skip
        else:
            opts = client.V1DeleteOptions(
                preconditions=client.V1Preconditions(
                    resource_version=obj["metadata"]["resourceVersion"]
                )
            )
            await asyncio.to_thread(
                custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, IMAGE_CACHES,
                name, body=opts,
            )  # fmt: skip
    except ApiException as exc:
        if exc.status not in (404, 409):
            raise
        return exc.status == 404
    return True
