"""Version changes in the cold-start simulator's models file: ``releases:`` and ``--release``.

Pure. A model's ``releases`` are new revisions during the run, in time order: at each
``at`` the spec's revision changes (to ``size`` bytes, by default the previous
revision's) and the live planner rolls the endpoint (``control.rollout``: surge, the
cache gate, old replicas drained once new ones serve); its starts are ``new_version``.
``--release NAME@TIME[=SIZE]`` adds one on the command line. Errors name the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from preheat.config import parse_size
from preheat.errors import ConfigError
from preheat.sim.coldstart_config import Catalog, Release, parse_duration

__all__ = ["releases_from", "with_releases"]

_MAX_RELEASES = 100  # per model


def releases_from(where: str, raw: Any, size: int) -> tuple[Release, ...]:
    """``releases:``: a list of ``{at: DURATION, size: SIZE}`` in time order."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where} releases = {raw!r}; give a list like [{{at: 8h}}]")
    if len(raw) > _MAX_RELEASES:
        raise ConfigError(f"{where} lists {len(raw)} releases; at most {_MAX_RELEASES}")
    out: list[Release] = []
    for i, item in enumerate(raw):
        at_where = f"{where} releases[{i}]"
        if not isinstance(item, Mapping) or "at" not in item:
            raise ConfigError(f"{at_where} = {item!r}; give a mapping like {{at: 8h}}")
        extra = sorted(set(item) - {"at", "size"})
        if extra:
            raise ConfigError(f"{at_where}: unknown key(s) {extra}; known: at, size")
        at = parse_duration(item["at"], what=f"{at_where}.at")
        if out and at <= out[-1].at:
            raise ConfigError(
                f"{at_where}.at = {item['at']!r} is not after the release before it "
                f"({out[-1].at:g} s); list releases in time order"
            )
        new_size = size if not out else out[-1].size
        if "size" in item:
            new_size = parse_size(item["size"], what=f"{at_where}.size")
            if new_size <= 0:
                raise ConfigError(f"{at_where}.size {item['size']!r} must be above zero")
        out.append(Release(at, new_size))
    return tuple(out)


def with_releases(catalog: Catalog, texts: list[str] | tuple[str, ...]) -> Catalog:
    """``--release NAME@TIME[=SIZE]`` (repeatable): each adds a release to the model,
    merged in time order with the file's own, e.g. ``model-01@12h`` or
    ``model-01@12h=650GB`` (without a size: the revision before it's)."""
    extra: dict[str, list[dict[str, Any]]] = {}
    names = {m.name for m in catalog.models}
    for text in texts:
        name, sep, rest = text.partition("@")
        at, _, size = rest.partition("=")
        if not sep or not at.strip():
            raise ConfigError(
                f"--release {text!r}; write MODEL@TIME or MODEL@TIME=SIZE, e.g. model-01@12h"
            )
        if name not in names:
            shown = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")
            raise ConfigError(f"--release {text!r} names no model of the models file ({shown})")
        item: dict[str, Any] = {"at": parse_duration(at, what=f"--release {text!r}: time")}
        if size:
            item["size"] = parse_size(size, what=f"--release {text!r}: size")
        extra.setdefault(name, []).append(item)
    models = []
    for m in catalog.models:
        if m.name not in extra:
            models.append(m)
            continue
        given: list[dict[str, Any]] = [{"at": r.at, "size": r.size} for r in m.releases]
        items = sorted([*given, *extra[m.name]], key=lambda d: float(d["at"]))
        releases = releases_from(f"model {m.name!r}", items, m.size)
        models.append(dataclasses.replace(m, releases=releases))
    return dataclasses.replace(catalog, models=tuple(models))
