"""Prometheus gauges for warm-ups: per-node time and bytes per source, origin bytes per
revision (the fleet's ``/metrics``; read live from the fleet's records at scrape time).

    preheat_warmup_seconds{node, revision}            the last finished warm-up's duration
    preheat_warmup_bytes{node, revision, source}      its bytes from origin / peer / cache
    preheat_revision_origin_bytes{revision}           origin bytes for a revision, all nodes
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from preheat.telemetry.records import WarmupRecord

__all__ = ["WarmupCollector"]


class WarmupCollector(Collector):
    """``records()`` gives (node, revision) -> ``WarmupRecord``; ``origin()`` gives
    (node, revision) -> bytes fetched from the origin."""

    def __init__(
        self,
        records: Callable[[], Mapping[tuple[str, str], WarmupRecord]],
        origin: Callable[[], Mapping[tuple[str, str], int]],
    ) -> None:
        self._records = records
        self._origin = origin

    def collect(self) -> Iterator[Metric]:
        seconds = GaugeMetricFamily(
            "preheat_warmup_seconds",
            "Duration of the last finished warm-up of a revision on a node (waits included)",
            labels=["node", "revision"],
        )
        moved = GaugeMetricFamily(
            "preheat_warmup_bytes",
            "Bytes of the last finished warm-up of a revision on a node, by source",
            labels=["node", "revision", "source"],
        )
        for (node, rev), rec in sorted(dict(self._records()).items()):
            seconds.add_metric([node, rev], rec.seconds)
            for source in ("origin", "peer", "cache"):
                moved.add_metric([node, rev, source], rec.bytes_from.get(source, 0))
        per_rev: dict[str, int] = {}
        for (_, rev), n in dict(self._origin()).items():
            per_rev[rev] = per_rev.get(rev, 0) + n
        origin = GaugeMetricFamily(
            "preheat_revision_origin_bytes",
            "Bytes fetched from the origin for a revision over all nodes",
            labels=["revision"],
        )
        for rev, n in sorted(per_rev.items()):
            origin.add_metric([rev], n)
        yield seconds
        yield moved
        yield origin
