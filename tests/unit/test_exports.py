"""The public API is exactly what we meant to export."""

from __future__ import annotations

import subprocess
import sys

import preheat

EXPECTED = {
    "__version__",
    "NodeStore",
    "PullResult",
    "EndpointSpec",
    "ClusterSpec",
    "load_endpoint",
    "load_cluster",
    "LocalFleet",
    "Router",
    "RouterConfig",
    "KVCache",
    "get_profile",
    "StartRecord",
}


def test_public_names() -> None:
    """__all__ is the list we meant, and every name resolves to a real object."""
    assert set(preheat.__all__) == EXPECTED
    for name in preheat.__all__:
        assert getattr(preheat, name) is not None, name


def test_unknown_name_is_attribute_error() -> None:
    """A misspelt name fails like any module attribute would."""
    try:
        preheat.NodeStroe  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NodeStroe" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_light() -> None:
    """`import preheat` loads none of the heavy integrations."""
    code = "import sys, preheat; print(','.join(m for m in ('aiohttp','boto3','sqlite3','matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_all_matches_lazy_table() -> None:
    """Every lazily exported name is in __all__ and the reverse."""
    assert set(preheat.__all__) - {"__version__"} == set(preheat._EXPORTS)
