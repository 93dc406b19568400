"""The External metrics API's objects and arithmetic (pure).

``preheat metrics-adapter`` serves ``external.metrics.k8s.io/v1beta1`` the way
kubernetes-sigs/custom-metrics-apiserver lays it out, to the HPA controller (through the
API server's aggregator):

* ``GET /apis/external.metrics.k8s.io/v1beta1``: an ``APIResourceList`` naming each
  metric as a namespaced resource with the verb ``get`` (what prometheus-adapter lists);
* ``GET /apis/external.metrics.k8s.io/v1beta1/namespaces/NS/METRIC?labelSelector=SEL``:
  an ``ExternalMetricValueList``, one item per series that matches ``SEL`` with
  ``metricName``, ``metricLabels``, ``timestamp`` (RFC 3339) and ``value`` (a quantity).

The one metric, :data:`~preheat.runtime.kubernetes.autoscaler.IN_FLIGHT_METRIC`, is
one series per endpoint variant with the labels ``endpoint`` and ``variant``: the sum,
over every ready router of the endpoint, of the router's ``preheat_router_in_flight``
samples of that variant (one per instance). The rendered HPA asks for
``endpoint=E,variant=V`` with an ``AverageValue`` target, so the HPA controller divides
the sum by the Deployment's pod count: requests in flight per replica, as local mode's
``control.autoscale`` computes it.

Label selectors are parsed as the API server writes them (``labels.Selector.String()``):
``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` and ``!k``,
joined by commas.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from preheat.errors import ConfigError
from preheat.runtime.kubernetes.autoscaler import IN_FLIGHT_METRIC

__all__ = [
    "GROUP",
    "GROUP_VERSION",
    "METRICS",
    "Requirement",
    "api_resource_list",
    "format_quantity",
    "in_flight_by_variant",
    "parse_selector",
    "pinned",
    "router_service_name",
    "selector_matches",
    "status_body",
    "value_list",
]

GROUP = "external.metrics.k8s.io"
VERSION = "v1beta1"
GROUP_VERSION = f"{GROUP}/{VERSION}"
#: Every metric the adapter serves (what the rendered HPAs use).
METRICS = (IN_FLIGHT_METRIC,)

_KEY = r"(?P<key>[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?)"
_VALUE = r"(?P<value>(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?)"
_SET = re.compile(rf"^{_KEY}\s+(?P<op>in|notin)\s+\((?P<values>[^()]*)\)$")
_CMP = re.compile(rf"^{_KEY}\s*(?P<op>==|=|!=)\s*{_VALUE}$")
_EXISTS = re.compile(rf"^(?P<neg>!?)\s*{_KEY}$")


@dataclass(frozen=True)
class Requirement:
    """One term of a label selector: ``key`` with ``op`` (``in``, ``notin``, ``exists``,
    ``!``) over ``values`` (``=``/``==`` is ``in`` one value, ``!=`` is ``notin``)."""

    key: str
    op: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!":
            return self.key not in labels
        if self.op == "in":
            return labels.get(self.key) in self.values
        return labels.get(self.key) not in self.values  # notin: a missing key matches

    def equals(self) -> str | None:
        """The one value this term pins its key to (``k=v``, ``k in (v)``), else None."""
        return self.values[0] if self.op == "in" and len(self.values) == 1 else None


def _split_terms(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    terms: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    terms.append("".join(cur).strip())
    return [t for t in terms if t]


def parse_selector(text: str) -> tuple[Requirement, ...]:
    """The requirements of a label selector string; raises ``ConfigError`` naming the term
    that does not parse."""
    out = []
    for term in _split_terms(text or ""):
        if m := _SET.match(term):
            values = tuple(v.strip() for v in m["values"].split(",") if v.strip())
            out.append(Requirement(m["key"], m["op"], values))
            continue
        if m := _CMP.match(term):
            op = "notin" if m["op"] == "!=" else "in"
            out.append(Requirement(m["key"], op, (m["value"],)))
            continue
        if m := _EXISTS.match(term):
            out.append(Requirement(m["key"], "!" if m["neg"] else "exists"))
            continue
        raise ConfigError(
            f"label selector term {term!r} does not parse; write key=value, key!=value, "
            "key in (a,b), key notin (a,b), key or !key, joined by commas"
        )
    return tuple(out)


def selector_matches(reqs: Sequence[Requirement], labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` satisfy every requirement."""
    return all(r.matches(labels) for r in reqs)


def pinned(reqs: Sequence[Requirement], key: str) -> str | None:
    """The value the selector pins ``key`` to, if one term does."""
    for r in reqs:
        if r.key == key and (v := r.equals()) is not None:
            return v
    return None


def router_service_name(endpoint: str) -> str:
    """The router Service of an endpoint (``preheat k8s render -f`` names it so)."""
    return f"preheat-router-{endpoint}"


def in_flight_by_variant(samples: Iterable[tuple[Mapping[str, str], float]]) -> dict[str, float]:
    """Per variant, the sum of ``preheat_router_in_flight`` samples (``(labels, value)``
    as scraped from one or more routers; one sample per instance)."""
    out: dict[str, float] = {}
    for labels, value in samples:
        variant = labels.get("variant")
        if variant is not None:
            out[variant] = out.get(variant, 0.0) + value
    return out


def format_quantity(value: float) -> str:
    """A Kubernetes quantity: an integer as is, else milli-units (rounded up)."""
    if value == int(value):
        return str(int(value))
    milli = -(-value * 1000 // 1)
    return f"{int(milli)}m"


def api_resource_list(metrics: Sequence[str] = METRICS) -> dict[str, Any]:
    """The discovery document of ``external.metrics.k8s.io/v1beta1``."""
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            {
                "name": m,
                "singularName": "",
                "namespaced": True,
                "kind": "ExternalMetricValueList",
                "verbs": ["get"],
            }
            for m in metrics
        ],
    }


def value_list(
    metric: str, series: Iterable[tuple[Mapping[str, str], float]], *, timestamp: str
) -> dict[str, Any]:
    """An ``ExternalMetricValueList`` with one item per ``(labels, value)`` series."""
    return {
        "kind": "ExternalMetricValueList",
        "apiVersion": GROUP_VERSION,
        "metadata": {},
        "items": [
            {
                "metricName": metric,
                "metricLabels": dict(labels),
                "timestamp": timestamp,
                "value": format_quantity(value),
            }
            for labels, value in series
        ],
    }


_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            503: "ServiceUnavailable"}  # fmt: skip


def status_body(code: int, message: str) -> dict[str, Any]:
    """A ``meta/v1`` ``Status`` failure, as any API server answers an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, "InternalError"),
        "code": code,
    }
