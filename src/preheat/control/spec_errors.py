"""The endpoint spec's and cluster file's error messages: pydantic's errors rewritten to
name the object, the field as the user wrote it, the bad value and the fix.
"""

from __future__ import annotations

from pydantic import ValidationError

from preheat.errors import ConfigError

__all__ = ["bad", "field_path", "pydantic_message"]


def field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic reports union members by class name; they are not user fields.
            if part.startswith("_") or part in {"list[str]", "str", "int", "function-after"}:
                continue
            out += ("." if out else "") + part
    return out


def pydantic_message(where: str, exc: ValidationError) -> str:
    lines = []
    errors = exc.errors()
    if len(errors) > 1:
        # A union (``nodes: {selector} | [names]``) reports one error per member; the
        # "should be a list" complaint only hides the real one.
        errors = [e for e in errors if e["type"] != "list_type"] or errors
    for err in errors:
        loc = field_path(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "is not a known field; check its spelling (see docs/fleet.md for the shape)"
        elif err["type"] == "missing":
            msg = "is required"
        elif "input" in err and err["type"] != "value_error":
            msg = f"{err['input']!r}: {msg}"
        lines.append(f"{where}: {loc} {msg}".replace(":  ", ": "))
    # One line per problem, de-duplicated (union members can repeat one complaint).
    return "\n".join(dict.fromkeys(lines))


def bad(where: str, text: str) -> ConfigError:
    return ConfigError(f"{where}: {text}")
