"""OpenAPI v3 schema builders for the preheat CRDs' structural schemas.

Each returns one schema node (a plain dict, as ``apiextensions.k8s.io/v1`` wants it);
an empty description is left out.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Schema",
    "array",
    "boolean",
    "free_form",
    "integer",
    "node_selector",
    "number",
    "obj",
    "str_map",
    "string",
]

Schema = dict[str, Any]


def string(description: str = "", **kw: Any) -> Schema:
    out: Schema = {"type": "string", **kw}
    if description:
        out["description"] = description
    return out


def integer(
    description: str = "", minimum: int | None = None, maximum: int | None = None
) -> Schema:
    out: Schema = {"type": "integer", "format": "int64"}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    if description:
        out["description"] = description
    return out


def number(description: str = "", minimum: float | None = None) -> Schema:
    out: Schema = {"type": "number"}
    if minimum is not None:
        out["minimum"] = minimum
    if description:
        out["description"] = description
    return out


def boolean(description: str = "") -> Schema:
    return {"type": "boolean", **({"description": description} if description else {})}


def obj(props: dict[str, Schema], description: str = "", required: tuple[str, ...] = ()) -> Schema:
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if description:
        out["description"] = description
    return out


def str_map(description: str = "") -> Schema:
    return {
        "type": "object",
        "additionalProperties": {"type": "string"},
        **({"description": description} if description else {}),
    }


def array(items: Schema, description: str = "") -> Schema:
    return {
        "type": "array",
        "items": items,
        **({"description": description} if description else {}),
    }


def free_form(description: str) -> Schema:
    """A field whose shape is Kubernetes' own (tolerations, resources): kept as written."""
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "description": description,
    }


def node_selector(*, exclude: bool = False) -> Schema:
    """Target nodes; ``exclude`` adds the operator-written list of nodes taken out of the
    targets (a ``ModelDataCache`` whose revision gave up a node, ``control.plan`` step 6)."""
    props: dict[str, Schema] = {
        "names": array(string(), "Explicit node names."),
        "selector": str_map("Node labels that must all match."),
    }
    if exclude:
        props["exclude"] = array(
            string(), "Nodes taken out of the targets (the operator: no longer kept there)."
        )
    return obj(props, "Target nodes: names or a label selector (empty: every node).")
