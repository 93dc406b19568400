"""Local mode's cluster-wide revocation list: one list, applied to every node's store.

``preheat revoke KEY`` (the control API's ``POST /revoke``) puts a revision, snapshot
digest or blob/image digest on the fleet's list, kept in ``<state>/revocations.json`` so a
restarted ``preheat up`` keeps it. The list is applied to every node's store
(``store.revoke``: what no replica holds is removed, every new pull of it is refused) and
to every node that joins later; ``unrevoke`` lifts it everywhere. The planner sees the
revoked *revisions* (``FleetRevocations.revisions``) and rolls the variants that run one to their
``model.fallback`` or reports them (``control.revocation``); a revoked layer digest
revokes the ``oci://`` revisions built from it, known from the stores' records of what
they unpacked and from the registry's manifests (``learn_layers``: a fallback no node
ever pulled is never chosen). A snapshot that a replica
still holds is removed by the planner's clean-up once that replica is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from preheat.artifacts.refs import redact_url
from preheat.control.revocation import revoked_by_layers
from preheat.control.spec_types import ModelSpec
from preheat.errors import ControlError, FetchError, PreheatError
from preheat.runtime.image_warmup import ImageWarmer
from preheat.runtime.model import FleetState, Node, ResolvedVariant
from preheat.runtime.nodestore import resolve_source
from preheat.sources.oci import manifest_layers, revision_layers
from preheat.sources.oci_layer_meta import layer_users
from preheat.store.revoke import normalise

__all__ = ["FleetRevocations", "resolve_fallbacks", "resolve_image_fallbacks"]


@dataclass
class FleetRevocations:
    """The fleet's list (key -> reason, since) and its file."""

    path: Path
    entries: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: key -> revisions it was found to name (a snapshot digest names the revision whose
    #: snapshot it is; remembered because the snapshot is gone once revoked).
    names: dict[str, frozenset[str]] = field(default_factory=dict)
    #: ``oci://`` revision -> the digests of its layers, asked of the registry once
    #: (``learn_layers``; a manifest digest's layers never change).
    layers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Revisions whose layers could not be asked for (said once until they are).
    unknown: set[str] = field(default_factory=set)

    @classmethod
    def load(cls, state_dir: Path) -> FleetRevocations:
        path = Path(state_dir) / "revocations.json"
        out = cls(path)
        with contextlib.suppress(FileNotFoundError):
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ControlError(f"{path}: not a JSON object of revocations; fix or remove it")
            for k, v in raw.items():
                key = normalise(k)
                out.entries[key] = (str(v.get("reason", "")), float(v.get("since", 0)))
                out.names[key] = frozenset(str(r) for r in v.get("revisions", []))
        return out

    def _save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        doc = {
            k: {"reason": r, "since": t, "revisions": sorted(self.names.get(k, ()))}
            for k, (r, t) in sorted(self.entries.items())
        }
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.path)

    async def apply_to(self, nodes: Iterable[Node], keys: Iterable[str] | None = None) -> int:
        """Put ``keys`` (default: every listed key) on each open node store; snapshots
        removed in all."""
        removed = 0
        for key in list(self.entries) if keys is None else list(keys):
            reason = self.entries[key][0]
            for node in nodes:
                if node.cache.closed:
                    continue
                rep = await asyncio.to_thread(node.cache.store.revoke, key, reason)
                removed += len(rep.removed)
        return removed

    async def revoke(self, st: FleetState, key: str, reason: str) -> dict[str, object]:
        key = normalise(key)
        self.entries[key] = (reason or "revoked", time.time())
        self.names[key] = _names(st, key)
        self._save()
        removed = await self.apply_to(st.nodes.values(), [key])
        st.say(
            f"revoked {key[:24]} on {len(st.nodes)} node(s) ({reason or 'no reason given'}): "
            f"{removed} unused snapshot(s) removed; replicas that run it roll to a fallback"
        )
        st.wake()
        return {"key": key, "nodes": len(st.nodes), "removed": removed}

    async def unrevoke(self, st: FleetState, key: str) -> bool:
        key = normalise(key)
        was = self.entries.pop(key, None) is not None
        self.names.pop(key, None)
        if was:
            self._save()
        for node in st.nodes.values():
            if not node.cache.closed:
                await asyncio.to_thread(node.cache.store.unrevoke, key)
        if was:
            st.say(f"unrevoked {key[:24]} on every node")
            st.wake()
        return was

    def document(self) -> list[dict[str, object]]:
        return [
            {"key": k, "reason": r, "since": t, "revisions": sorted(self.names.get(k, ()))}
            for k, (r, t) in sorted(self.entries.items())
        ]

    def revisions(self, known: Iterable[str]) -> frozenset[str]:
        """The revisions the list revokes, among ``known`` and those named at revoke time,
        and the known ``oci://`` revisions built from a revoked layer (``learn_layers``),
        whether or not a node ever pulled them."""
        if not self.entries:
            return frozenset()
        known = set(known)
        out = {r for r in known if normalise(r) in self.entries}
        for names in self.names.values():
            out |= names
        layers = {r: ds for r, ds in self.layers.items() if r in known}
        return frozenset(out | revoked_by_layers(self.entries.keys(), layers))

    async def built_from_revoked(self, st: FleetState, variant: str, m: ModelSpec) -> bool:
        """Whether the ``oci://`` fallback ``m`` of ``variant`` is built from a layer on the
        list (its manifest read, its layers remembered; said when it is). False for other
        sources and when the registry does not answer (the full resolve then says so)."""
        if not self.entries or not m.source.startswith("oci://"):
            return False
        try:
            rev, layers = await revision_layers(m.source, m.revision)
        except (PreheatError, OSError):
            return False
        self.layers[rev] = layers
        hit = sorted(set(layers) & self.entries.keys())
        if hit:
            st.say(
                f"{variant}: fallback {redact_url(m.source)} ({rev[:19]}) is built from the "
                f"revoked layer {hit[0][:19]}; it is not chosen"
            )
        return bool(hit)

    async def learn_layers(self, st: FleetState) -> None:
        """Ask the registry for the layer digests of every known ``oci://`` revision not
        asked yet (the main ones and resolved fallbacks; only while the list is not
        empty), so a revoked layer revokes a revision no store unpacked, as the
        Kubernetes operator does. A registry that does not answer is said and asked again
        on the next pass. A fallback found built from a revoked layer is said once."""
        if not self.entries:
            return
        for rev, rv in list(st.known.items()):
            if not rv.source.startswith("oci://") or rev in self.layers:
                continue
            try:
                self.layers[rev] = await manifest_layers(rv.source, rev)
            except (PreheatError, OSError) as exc:
                if rev in self.unknown:
                    continue
                self.unknown.add(rev)
                st.say(
                    f"{rv.variant}: the layers of {redact_url(rv.source)} are not known "
                    f"({redact_url(str(exc))}); asked again on the next pass"
                )
                continue
            self.unknown.discard(rev)
            hit = sorted(set(self.layers[rev]) & self.entries.keys())
            if hit and rev not in {r.revision for r in st.resolved.values()}:
                st.say(
                    f"{rv.variant}: fallback {redact_url(rv.source)} ({rev[:19]}) is built "
                    f"from the revoked layer {hit[0][:19]}; it is not chosen"
                )


def _names(st: FleetState, key: str) -> frozenset[str]:
    """Known revisions whose snapshot on some node has manifest digest ``key`` or was
    unpacked from the tar layer ``key`` (``oci_stage.layer_users``)."""
    out: set[str] = set()
    built: set[str] = set()
    for node in st.nodes.values():
        built |= layer_users(node.cache.store.root, key)
    for rev in list(st.known):
        if normalise(rev) == key or rev in built:
            out.add(rev)
            continue
        for node in st.nodes.values():
            with contextlib.suppress(Exception):
                if (
                    node.cache.has(rev)
                    and f"sha256:{node.cache.store.snapshot_path(rev).name}" == key
                ):
                    out.add(rev)
                    break
    return frozenset(out)


async def resolve_image_fallbacks(st: FleetState, images: ImageWarmer) -> None:
    """Resolve each variant's ``image.fallback`` list once its image is revoked; one
    that does not resolve is left out (and said) until the next apply."""
    for v in st.spec.variants:
        if v.name in st.image_fallbacks or not v.image_fallback:
            continue
        out = []
        for ref in v.image_fallback:
            digests = await images.digests(ref)
            if digests is None:
                st.say(f"{v.name}: image fallback {ref} does not resolve; skipped")
                continue
            out.append((ref, digests))
        st.image_fallbacks[v.name] = tuple(out)


async def resolve_fallbacks(st: FleetState, revocations: FleetRevocations | None = None) -> None:
    """Resolve each variant's ``model.fallback`` list once a revocation needs it; a
    fallback whose origin does not answer is left out (and said) until the next apply,
    and so is an ``oci://`` one built from a layer on ``revocations``' list (its manifest
    is read first: the revoked layer is not fetched to resolve it)."""
    for v in st.spec.variants:
        if v.name in st.fallbacks or not v.model.fallback:
            continue
        out = []
        for m in v.model.fallback:
            if revocations is not None and await revocations.built_from_revoked(st, v.name, m):
                continue
            try:
                revision, total, files = await resolve_source(m.source)
            except FetchError as exc:
                st.say(f"{v.name}: fallback {m.source} does not resolve ({exc}); skipped")
                continue
            if m.revision is not None and m.revision != revision:
                st.say(
                    f"{v.name}: fallback {m.source} resolves to {revision[:24]}, not the "
                    f"pinned {m.revision[:24]}; skipped"
                )
                continue
            rv = ResolvedVariant(v.name, m.source, revision, total, files)
            st.known.setdefault(revision, rv)
            out.append(rv)
        st.fallbacks[v.name] = tuple(out)
