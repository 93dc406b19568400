"""Shared fixtures: free ports for tests that start real servers."""

from __future__ import annotations

import pytest

from preheat.testing.procs import free_port as _free_port


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()
