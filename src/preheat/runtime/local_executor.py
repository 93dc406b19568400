"""Local mode's ``Executor``: node stores on disk, replica processes, a router child.

``observe`` resolves the sources (retrying an unreachable origin with backoff, the
reason in status), keeps the nodes' cache views true to their stores at every tick
(``runtime.cache_views``: held copies adopted, evicted ones no longer ``ready``), starts
the image pre-pulls that are due (``Warmer.images``, beside the planner: they gate nothing), samples the router's in-flight counts for the autoscaler, and builds ``Desired`` and
``Observed`` from the fleet's bookkeeping (``model.FleetState``). The action methods
carry out the planner's decisions through ``warmup.Warmer`` and
``replicas.Supervisor``; each is idempotent (see ``runtime.reconcile``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque

from preheat.config import format_size
from preheat.control.autoscale import AutoscaleState, autoscale
from preheat.control.spec import EndpointSpec
from preheat.control.state import (
    AddRoute,
    DeleteRevision,
    Desired,
    DesiredVariant,
    Drain,
    FinishRollout,
    NodeView,
    Notice,
    Observed,
    OpenGate,
    ReplicaView,
    Revoked,
    Rollback,
    StartReplica,
    StopReplica,
    Unschedulable,
    VariantStatus,
    WaitGate,
    Warm,
    WeightsPolicy,
)
from preheat.errors import ConfigError, ControlError, FetchError, PreheatError
from preheat.runtime.cache_views import EvictionWatch, adopt_existing
from preheat.runtime.model import (
    FleetState,
    ReplicaPhase,
    ResolvedVariant,
    WarmState,
    cache_view,
)
from preheat.runtime.nodestore import resolve_source
from preheat.runtime.replicas import Supervisor
from preheat.runtime.revocations import (
    FleetRevocations,
    resolve_fallbacks,
    resolve_image_fallbacks,
)
from preheat.runtime.router_proc import RouterProcess
from preheat.runtime.warmup import Warmer, backoff

__all__ = ["AUTOSCALE_SAMPLE", "AUTOSCALE_WINDOW", "LocalExecutor", "resolve_variants"]

AUTOSCALE_SAMPLE = 0.25  # seconds between samples of the router's in-flight counts
AUTOSCALE_WINDOW = 2.0  # seconds of samples averaged into one load figure


async def resolve_variants(spec: EndpointSpec) -> dict[str, ResolvedVariant]:
    """Each variant's source resolved now (one resolve per distinct source); a
    ``model.revision`` that does not match what the source serves is a ConfigError."""
    out: dict[str, ResolvedVariant] = {}
    cache: dict[str, ResolvedVariant] = {}
    for v in spec.variants:
        if v.model.source not in cache:
            revision, total, files = await resolve_source(v.model.source)
            if v.model.revision is not None and v.model.revision != revision:
                raise ConfigError(
                    f"endpoint {spec.name!r}: variant {v.name!r} model.revision "
                    f"{v.model.revision!r} does not match what {v.model.source} resolves "
                    f"to now ({revision!r}); update model.revision or the origin"
                )
            cache[v.model.source] = ResolvedVariant(v.name, v.model.source, revision, total, files)
        out[v.name] = dataclasses.replace(cache[v.model.source], variant=v.name)
    return out


def describe_revisions(resolved: dict[str, ResolvedVariant]) -> str:
    return ", ".join(
        f"{name} -> {rv.revision[:12]} ({format_size(rv.model_bytes)})"
        for name, rv in resolved.items()
    )


class LocalExecutor:
    """Implements ``runtime.reconcile.Executor`` for one machine."""

    def __init__(
        self,
        state: FleetState,
        router: RouterProcess,
        warmer: Warmer,
        supervisor: Supervisor,
        revocations: FleetRevocations | None = None,
    ) -> None:
        self.state = state
        self.revocations = revocations
        self.router = router
        self.warmer = warmer
        self.supervisor = supervisor
        self._resolve_retry_at = 0.0
        self._resolve_failures = 0
        self._load_samples: deque[tuple[float, dict[str, int]]] = deque()
        self._autoscale_state: dict[str, AutoscaleState] = {}
        self._evictions = EvictionWatch()

    def remember(self, resolved: dict[str, ResolvedVariant]) -> None:
        """Take ``resolved`` as the spec's revisions (and keep them known for rollbacks)."""
        self.state.resolved = resolved
        for rv in resolved.values():
            self.state.known[rv.revision] = rv

    # --- observe ----------------------------------------------------------------------

    async def observe(self) -> tuple[Desired, Observed] | None:
        st = self.state
        # Images never wait for the weights (nor the weights for them).
        await self.warmer.images.sync()
        if len(st.resolved) < len(st.spec.variants):
            if st.clock.now() < self._resolve_retry_at:
                return None
            try:
                self.remember(await resolve_variants(st.spec))
            except FetchError as exc:
                delay = backoff(self._resolve_failures)
                self._resolve_failures += 1
                self._resolve_retry_at = st.clock.now() + delay
                st.resolve_error = f"{exc}; retrying in {delay:.0f} s"
                return None
            st.resolve_error = None
            self._resolve_failures = 0
            st.say(f"resolved {describe_revisions(st.resolved)}")
            await adopt_existing(st)
        await self._evictions.forget_evicted(st)
        if st.spec.autoscaling is not None:
            await self._autoscale()
        if self.revocations is not None and self.revocations.entries:
            for v in st.spec.variants:  # the digest each image runs, once per image
                if v.image and v.image not in st.image_digests:
                    await self.warmer.images.digests(v.image)
            await self.revocations.learn_layers(st)
        revoked = self._revoked()
        for name in list(st.revoked):
            rv = st.resolved.get(name)
            image = st.image_digests.get(st.spec.variant(name).image or "", ())
            if rv is None or (rv.revision not in revoked and not revoked.intersection(image)):
                del st.revoked[name]  # lifted (unrevoke) or the spec moved on
        if revoked & {rv.revision for rv in st.resolved.values()}:
            await resolve_fallbacks(st, self.revocations)
            if self.revocations is not None:  # the fallbacks' layers, before one is chosen
                await self.revocations.learn_layers(st)
                revoked = self._revoked()
        if any(
            revoked.intersection(st.image_digests.get(v.image or "", ())) for v in st.spec.variants
        ):
            await resolve_image_fallbacks(st, self.warmer.images)
            revoked = self._revoked()
        st.revoked_keys = revoked
        return self._desired(), dataclasses.replace(self._observed(), revoked=revoked)

    def _revoked(self) -> frozenset[str]:
        if self.revocations is None:
            return frozenset()
        known = set(self.state.known)
        for fbs in self.state.fallbacks.values():
            known |= {f.revision for f in fbs}
        for digests in self.state.image_digests.values():
            known |= set(digests)
        return self.revocations.revisions(known)

    async def _autoscale(self) -> None:
        """Sample the router's in-flight counts; let ``control.autoscale`` set the counts."""
        st = self.state
        policy = st.spec.autoscaling
        assert policy is not None
        now = st.clock.now()
        if self._load_samples and now - self._load_samples[-1][0] < AUTOSCALE_SAMPLE:
            return
        try:
            config = await self.router.get_config()
        except ControlError:
            return
        per_variant = {
            v["name"]: sum(
                int(i.get("in_flight", 0)) for i in v.get("instances", []) if isinstance(i, dict)
            )
            for v in config.get("variants", [])
        }
        self._load_samples.append((now, per_variant))
        while self._load_samples and now - self._load_samples[0][0] > AUTOSCALE_WINDOW:
            self._load_samples.popleft()
        for v in st.spec.variants:
            samples = [s.get(v.name, 0) for _, s in self._load_samples]
            current = st.replica_counts.get(v.name, v.replicas.min)
            new, scale_state, why = autoscale(
                current=current,
                lo=v.replicas.min,
                hi=v.replicas.max,
                in_flight=sum(samples) / max(len(samples), 1),
                serving=st.ready_count(v.name),
                policy=policy,
                now=now,
                state=self._autoscale_state.get(v.name, AutoscaleState()),
            )
            self._autoscale_state[v.name] = scale_state
            if new != current:
                st.replica_counts[v.name] = new
                st.say(f"autoscale {v.name}: {why}")

    def _desired(self) -> Desired:
        st = self.state
        w = st.spec.cache.weights
        return Desired(
            endpoint=st.spec.name,
            variants=tuple(
                DesiredVariant(
                    v.name,
                    st.resolved[v.name].revision,
                    st.resolved[v.name].model_bytes,
                    st.replica_counts.get(v.name, v.replicas.min),
                    v.weight,
                    template=st.template(v),
                    fallbacks=tuple(
                        (f.revision, f.model_bytes) for f in st.fallbacks.get(v.name, ())
                    ),
                    image=st.image_digests.get(v.image or "", ()),
                    image_fallbacks=tuple(
                        (digests, st.template(dataclasses.replace(v, image=ref)))
                        for ref, digests in st.image_fallbacks.get(v.name, ())
                    ),
                )
                for v in st.spec.variants
            ),
            weights=WeightsPolicy(
                enabled=w.enabled,
                min_ready=w.min_ready,
                timeout_seconds=w.timeout_seconds,
                pin=w.pin,
                priority=w.priority,
            ),
        )

    def _observed(self) -> Observed:
        st = self.state
        nodes = tuple(
            NodeView(
                name=n.spec.name,
                up=n.up,
                slots=n.spec.slots,
                target=st.is_target(n),
                cache=tuple(sorted(n.views.items())),
            )
            for n in st.nodes.values()
        )
        replicas = tuple(
            ReplicaView(
                r.id,
                r.variant,
                r.revision,
                r.node,
                r.phase.value,
                routed=r.routed,
                seq=r.seq,
                template=r.template,
            )
            for r in st.live_replicas()
        )
        return Observed(
            now=st.clock.now(),
            nodes=nodes,
            replicas=replicas,
            variants=tuple(st.statuses.items()),
        )

    # --- actions ----------------------------------------------------------------------

    async def warm(self, a: Warm) -> None:
        self.warmer.start(a.node, a.revision)

    async def wait_gate(self, a: WaitGate) -> None:
        st = self.state
        vs = st.statuses.get(a.variant, VariantStatus())
        if vs.waiting_since(a.revision) is None:
            st.statuses[a.variant] = dataclasses.replace(
                vs, gate_since=(*vs.gate_since, (a.revision, st.clock.now()))
            )
            st.say(
                f"{a.variant}: waiting for {a.needed} target nodes to hold "
                f"{a.revision[:12]} before creating replicas"
            )
        reasons = []
        for name in a.waiting_on:
            node = st.nodes[name]
            view = node.views.get(a.revision, cache_view(WarmState.ABSENT))
            prog = node.progress.get(a.revision)
            extra = f" {100 * prog[0] / max(prog[1], 1):.0f}%" if prog else ""
            reasons.append(
                f"{name}: {view.state}{extra}" + (f" ({view.reason})" if view.reason else "")
            )
        st.waiting[a.variant] = (
            f"cache gate: {a.ready}/{a.needed} target nodes ready; " + "; ".join(reasons)
        )

    async def open_gate(self, a: OpenGate) -> None:
        st = self.state
        vs = st.statuses.get(a.variant, VariantStatus())
        st.statuses[a.variant] = dataclasses.replace(vs, gate_open=vs.gate_open | {a.revision})
        st.waiting.pop(a.variant, None)
        st.say(
            f"{a.variant}: cache gate open for {a.revision[:12]} "
            f"({a.ready}/{a.needed} target nodes ready)"
        )

    async def notice(self, a: Notice) -> None:
        self.state.say(a.text)

    async def revoked(self, a: Revoked) -> None:
        st = self.state
        if st.revoked.get(a.variant) != a.message:
            st.revoked[a.variant] = a.message
            st.say(a.message)

    async def unschedulable(self, a: Unschedulable) -> None:
        self.state.waiting[a.variant] = f"{a.missing} replica(s) cannot be placed: {a.reason}"

    async def start_replica(self, a: StartReplica) -> None:
        st = self.state
        sup = self.supervisor
        wait = sup.next_start_at.get(a.variant, 0.0) - st.clock.now()
        if wait > 0:
            # CrashLoopBackOff, as it were: failed starts back off exponentially.
            st.waiting[a.variant] = (
                f"{sup.start_failures[a.variant]} replica start(s) failed in a row; "
                f"next try in {wait:.0f} s (see {st.state_dir / 'logs'})"
            )
            return
        st.waiting.pop(a.variant, None)
        sup.start(a)

    async def add_route(self, a: AddRoute) -> None:
        r = self.state.replicas.get(a.replica)
        if r is not None:
            await self.supervisor.route(r)

    async def drain(self, a: Drain) -> None:
        r = self.state.replicas.get(a.replica)
        if r is not None and r.phase in (ReplicaPhase.STARTING, ReplicaPhase.READY):
            self.supervisor.drain(r, a.reason)

    async def stop_replica(self, a: StopReplica) -> None:
        r = self.state.replicas.get(a.replica)
        if r is not None and r.phase is not ReplicaPhase.STOPPED:
            self.state.say(f"stopping {r.id} on {r.node} ({a.reason})")
            await self.supervisor.kill(r)

    async def finish_rollout(self, a: FinishRollout) -> None:
        st = self.state
        vs = st.statuses.get(a.variant, VariantStatus())
        st.statuses[a.variant] = dataclasses.replace(vs, stable=a.revision)
        if a.previous is None:
            st.say(f"{a.variant}: deployed {a.revision[:12]}")
        else:
            st.say(f"{a.variant}: rolled out {a.revision[:20]} (was {a.previous[:20]})")

    async def rollback(self, a: Rollback) -> None:
        st = self.state
        vs = st.statuses.get(a.variant, VariantStatus())
        st.statuses[a.variant] = dataclasses.replace(
            vs, failed=vs.failed | {a.revision}, stable=vs.stable or a.to
        )
        st.say(f"{a.variant}: rolling back to {a.to[:12]}: {a.reason}")

    async def delete_revision(self, a: DeleteRevision) -> None:
        st = self.state
        node = st.nodes[a.node]
        node.views.pop(a.revision, None)
        node.progress.pop(a.revision, None)
        try:
            freed = await asyncio.to_thread(node.cache.delete, a.revision)
            st.say(f"deleted {a.revision[:12]} from {a.node} ({format_size(freed)} freed)")
        except PreheatError as exc:
            st.say(f"could not delete {a.revision[:12]} from {a.node}: {exc}")
