"""Shared fixtures: free ports for tests that start real servers; no silent skips in CI."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from preheat.testing.procs import free_port as _free_port

# Under CI=true nothing may silently skip: a missing binary (llama-server, the Kubernetes
# control plane), browser or server is a failure of the run, not a skip, so the summary
# line shows 0 skipped or the run fails.
_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if not _CI:
        return
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which must run everything: {reason}"
