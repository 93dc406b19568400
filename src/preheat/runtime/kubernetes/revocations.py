"""Kubernetes mode's cluster-wide revocation list: ``Revocation`` objects (cluster-scoped).

A user (or a security pipeline) creates one ``Revocation`` per revoked key::

    apiVersion: preheat.dev/v1alpha1
    kind: Revocation
    metadata: {name: cve-2026-0001}
    spec: {key: "sha256:…", reason: "CVE-2026-0001 in the tokenizer config"}

``spec.key`` is a model revision, a snapshot's manifest digest, or an image or blob
digest, as in ``preheat cache|image revoke``. Deleting the object lifts it.

* **Agents** (``AgentRevocations``) put every listed key on their store's revocation list
  (what no pod holds is removed at once, every new pull of it is refused), apply it again
  each pass so a snapshot held by a pod goes as soon as the pod is gone, lift the keys
  whose object was deleted (only keys they applied themselves: a key revoked by hand with
  ``preheat cache revoke`` stays), and list the applied keys in their NodeCache status.
  Which keys they applied is kept in ``<store>/cluster-revocations.json``, so a restarted
  agent lifts what was deleted while it was down.
* **The operator** writes each ``Revocation``'s status (``appliedNodes``, ``Ready`` once
  every NodeCache lists the key: ``sync_revocation_statuses``), and reads the list each pass (``revoked_revisions``) into the planner's
  ``Observed.revoked``: endpoints that run a revoked revision roll to their
  ``model.fallback`` (resolved here, once per generation, only when needed) or report
  ``Degraded=True Revoked``, with an Event either way. An image digest the same way
  (``ImageRevocations``): the variant's Deployment moves to its ``image.fallback``
  (``running_variant``), or the endpoint reports ``Degraded=True Revoked``. A layer
  digest of an ``oci://`` revision revokes that revision (``ImageRevocations.
  revoked_revisions``: the revision's manifest, asked of the registry once, lists its
  layers), so the endpoint rolls or degrades as for a revoked revision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from preheat.artifacts.refs import redact_url
from preheat.control.revocation import revoked_by_layers
from preheat.control.spec_types import EndpointSpec, VariantSpec
from preheat.errors import PreheatError
from preheat.images.cache import resolve_digests
from preheat.runtime.kubernetes import endpoint_status as es
from preheat.runtime.kubernetes.conditions import Condition, merge_conditions
from preheat.runtime.kubernetes.crds import GROUP, VERSION
from preheat.runtime.kubernetes.workload import template_fingerprint
from preheat.runtime.nodestore import open_source
from preheat.sources.oci import manifest_layers
from preheat.store.revoke import normalise
from preheat.store.store import NodeStore

__all__ = [
    "REVOCATIONS",
    "AgentRevocations",
    "ImageRevocations",
    "list_revocations",
    "resolve_fallbacks",
    "revocation_status",
    "revoked_revisions",
    "running_variant",
    "sync_revocation_statuses",
]

REVOCATIONS = "revocations"


def list_revocations(custom: Any) -> dict[str, str]:
    """key -> reason of every ``Revocation`` (none when the CRD is not installed).
    Blocking: call it from a thread."""
    try:
        resp = custom.list_cluster_custom_object(
            GROUP, VERSION, REVOCATIONS, _preload_content=False
        )
    except ApiException as exc:
        if exc.status == 404:
            return {}
        raise
    out: dict[str, str] = {}
    for obj in json.loads(resp.data).get("items") or ():
        spec = obj.get("spec") or {}
        key = spec.get("key")
        if isinstance(key, str) and key.strip() and not obj["metadata"].get("deletionTimestamp"):
            out[normalise(key)] = str(spec.get("reason") or obj["metadata"]["name"])
    return out


def revoked_revisions(keys: Mapping[str, str], resolved: Iterable[es.Resolved]) -> frozenset[str]:
    """Revisions among ``resolved`` that a key names (as itself or its manifest digest)."""
    if not keys:
        return frozenset()
    return frozenset(
        r.revision
        for r in resolved
        if normalise(r.revision) in keys or (r.digest and normalise(r.digest) in keys)
    )


async def resolve_fallbacks(spec: EndpointSpec) -> tuple[dict[str, list[es.Resolved]], list[str]]:
    """Each variant's ``model.fallback`` resolved; the ones that fail are left out, said."""
    out: dict[str, list[es.Resolved]] = {}
    problems: list[str] = []
    for v in spec.variants:
        got: list[es.Resolved] = []
        for m in v.model.fallback:
            src = open_source(m.source)
            try:
                res = await src.resolve()
            except PreheatError as exc:
                problems.append(f"{v.name}: fallback does not resolve ({exc})")
                continue
            finally:
                await src.aclose()
            if m.revision and m.revision not in (res.revision, res.manifest.digest):
                problems.append(
                    f"{v.name}: fallback resolves to {res.revision}, not the pinned {m.revision}"
                )
                continue
            got.append(
                es.Resolved(m.source, res.revision, res.manifest.digest, res.manifest.total_size)
            )
        out[v.name] = got
    return out, problems


class ImageRevocations:
    """The operator's view of its endpoint's images on the revocation list: the digests
    each variant's ``image`` names (a digest reference names itself; a tag is resolved
    with the registry once and remembered, so the answer stays once the image is
    revoked and gone), and each ``image.fallback`` list, resolved only while the image
    it backs is revoked. Also the layers of each ``oci://`` model revision, for
    revoked layers (``revoked_revisions``)."""

    def __init__(self) -> None:
        self.digests: dict[str, tuple[str, ...]] = {}
        #: ``oci://`` revision (manifest digest, immutable) -> its layer digests.
        self.layers: dict[str, tuple[str, ...]] = {}
        #: variant -> (its fallback refs as written, resolved ``(ref, digests)``).
        self.fallbacks: dict[
            str, tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]
        ] = {}

    async def _digests(self, ref: str, problems: list[str], what: str) -> tuple[str, ...] | None:
        if ref not in self.digests:
            try:
                self.digests[ref] = await resolve_digests(ref)
            except (PreheatError, OSError) as exc:
                problems.append(
                    f"{what} {redact_url(ref)} does not resolve ({redact_url(str(exc))})"
                )
                return None
        return self.digests[ref]

    async def revoked_revisions(
        self, keys: Mapping[str, str], resolved: Iterable[es.Resolved], problems: list[str]
    ) -> frozenset[str]:
        """``revoked_revisions``, plus the ``oci://`` revisions among ``resolved`` built
        from a revoked layer (their layers asked of the registry once; one that cannot
        be asked is said in ``problems`` and asked again next pass)."""
        resolved = list(resolved)
        direct = revoked_revisions(keys, resolved)
        if not keys:
            return direct
        for r in resolved:
            if r.source.startswith("oci://") and r.revision not in self.layers:
                try:
                    self.layers[r.revision] = await manifest_layers(r.source, r.revision)
                except (PreheatError, OSError) as exc:
                    note = f"{redact_url(r.source)}: layers not known ({redact_url(str(exc))})"
                    if note not in problems:
                        problems.append(note)
        known = {r.revision: self.layers.get(r.revision, ()) for r in resolved}
        return direct | revoked_by_layers(keys.keys(), known)

    async def revoked(
        self, spec: EndpointSpec, keys: Mapping[str, str]
    ) -> tuple[frozenset[str], list[str]]:
        """The image digests of ``spec`` (images and, when needed, fallbacks) that ``keys``
        revokes, and what did not resolve."""
        problems: list[str] = []
        if not keys:
            return frozenset(), problems
        out: set[str] = set()
        for v in spec.variants:
            if not v.image:
                continue
            mine = await self._digests(v.image, problems, f"{v.name}: image")
            hit = {d for d in mine or () if d in keys}
            if not hit:
                continue
            out |= hit
            have = self.fallbacks.get(v.name)
            if have is None or have[0] != v.image_fallback:
                got = []
                for ref in v.image_fallback:
                    d = await self._digests(ref, problems, f"{v.name}: image fallback")
                    if d is not None:
                        got.append((ref, d))
                self.fallbacks[v.name] = (v.image_fallback, tuple(got))
            out |= {d for _, ds in self.fallbacks[v.name][1] for d in ds if d in keys}
        return frozenset(out), problems

    def variant(
        self, v: VariantSpec
    ) -> tuple[tuple[str, ...], tuple[tuple[tuple[str, ...], str], ...]]:
        """``DesiredVariant.image`` and ``.image_fallbacks`` of ``v``."""
        fbs = self.fallbacks.get(v.name)
        resolved = fbs[1] if fbs is not None and fbs[0] == v.image_fallback else ()
        return self.digests.get(v.image or "", ()), tuple(
            (d, template_fingerprint(dataclasses.replace(v, image=ref))) for ref, d in resolved
        )


def running_variant(v: VariantSpec, template: str) -> VariantSpec:
    """``v`` with the ``image.fallback`` whose template is ``template`` (the planner moved
    the variant to it: its own image is revoked), else ``v``."""
    for ref in v.image_fallback:
        cand = dataclasses.replace(v, image=ref)
        if template_fingerprint(cand) == template:
            return cand
    return v


class AgentRevocations:
    """The node agent's side: the cluster list applied to its store (module docstring)."""

    def __init__(self, store: NodeStore, store_dir: Path) -> None:
        self.store = store
        self.path = Path(store_dir) / "cluster-revocations.json"
        self.applied: dict[str, str] = {}
        #: Keys whose snapshots pods still held at the last apply: applied again each pass.
        self.pending: set[str] = set()
        with contextlib.suppress(FileNotFoundError, ValueError):
            raw = json.loads(self.path.read_text())
            if isinstance(raw, dict):
                self.applied = {str(k): str(v) for k, v in raw.items()}

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.applied, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def sync(self, listed: Mapping[str, str]) -> list[str]:
        """Apply ``listed`` (key -> reason); lift keys this agent applied that are gone.
        Returns what changed, one line each (for the log and Events)."""
        changes: list[str] = []
        for key, reason in sorted(listed.items()):
            if self.applied.get(key) == reason and key not in self.pending:
                continue
            rep = self.store.revoke(key, reason)
            if rep.kept:
                self.pending.add(key)
            else:
                self.pending.discard(key)
            if key not in self.applied or rep.removed:
                kept = sum(1 for _ in rep.kept)
                changes.append(
                    f"revoked {key[:24]}: removed {len(rep.removed)} snapshot(s)"
                    + (f", {kept} kept while pods use them" if kept else "")
                )
            self.applied[key] = reason
        for key in sorted(set(self.applied) - set(listed)):
            self.store.unrevoke(key)
            del self.applied[key]
            self.pending.discard(key)
            changes.append(f"unrevoked {key[:24]}")
        if changes:
            self._save()
        return changes

    def status(self) -> list[dict[str, str]]:
        """For the NodeCache status: the cluster keys applied on this node."""
        return [{"key": k, "reason": r} for k, r in sorted(self.applied.items())]


def revocation_status(
    obj: Mapping[str, Any], nodecaches: Iterable[Mapping[str, Any]], *, now: str
) -> dict[str, Any]:
    """A ``Revocation``'s status: which nodes' agents applied it (from their NodeCache)."""
    key = normalise(str((obj.get("spec") or {}).get("key") or ""))
    nodes = sorted(
        str((nc.get("spec") or {}).get("node") or nc["metadata"]["name"]) for nc in nodecaches
    )
    applied = sorted(
        str((nc.get("spec") or {}).get("node") or nc["metadata"]["name"])
        for nc in nodecaches
        if any(r.get("key") == key for r in (nc.get("status") or {}).get("revocations") or ())
    )
    pending = [n for n in nodes if n not in applied]
    old = obj.get("status") or {}
    ready = Condition(
        "Ready",
        not pending,
        "AppliedOnAllNodes" if not pending else "Applying",
        f"applied on {len(applied)} of {len(nodes)} nodes"
        + (f"; waiting on {', '.join(pending[:5])}" if pending else ""),
    )
    generation = int(obj["metadata"].get("generation") or 1)
    return {
        "observedGeneration": generation,
        "appliedNodes": applied,
        "conditions": merge_conditions(
            old.get("conditions"), [ready], generation=generation, now=now
        ),
    }


def sync_revocation_statuses(custom: Any, now: str) -> int:
    """Write every ``Revocation``'s status that changed; returns how many. Blocking."""
    try:
        revs = (
            json.loads(
                custom.list_cluster_custom_object(
                    GROUP, VERSION, REVOCATIONS, _preload_content=False
                ).data
            ).get("items")
            or []
        )
    except ApiException as exc:
        if exc.status == 404:
            return 0
        raise
    if not revs:
        return 0
    ncs = (
        json.loads(
            custom.list_cluster_custom_object(
                GROUP, VERSION, "nodecaches", _preload_content=False
            ).data
        ).get("items")
        or []
    )
    wrote = 0
    for obj in revs:
        new = revocation_status(obj, ncs, now=now)
        old = obj.get("status") or {}
        if {k: v for k, v in new.items() if k != "conditions"} == {
            k: v for k, v in old.items() if k != "conditions"
        } and [(c["type"], c["status"], c["message"]) for c in new["conditions"]] == [
            (c["type"], c["status"], c["message"]) for c in old.get("conditions") or ()
        ]:
            continue
        custom.patch_cluster_custom_object_status(
            GROUP, VERSION, REVOCATIONS, obj["metadata"]["name"], {"status": new},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        wrote += 1
    return wrote
