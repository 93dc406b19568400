"""The generated report renders in a real browser: headless Chromium loads every plot."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from matplotlib.image import imread

from preheat.telemetry.events import EventClass
from preheat.telemetry.report import write_report
from preheat.testing.telemetry import synthetic_route_decisions, synthetic_starts

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="chromium not installed; run scripts/install-sysdeps.sh (Debian package 'chromium')",
    ),
]


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,2000",
        "--virtual-time-budget=10000",
        *args,
    ]
    # start_new_session: a timeout kills chromium's whole process group, helpers included.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    """Every <img> decodes (naturalWidth > 0), the tables are in the DOM, a screenshot is kept."""
    records = synthetic_starts(36, seed=11)
    decisions = tmp_path / "decisions.jsonl"
    synthetic_route_decisions(decisions, 200, seed=11)
    index = write_report(records, tmp_path / "report", route_decisions_path=decisions)
    n_imgs = index.read_text().count("<img ")
    assert n_imgs == 6

    dom = _chromium(tmp_path / "profile-dom", "--dump-dom", index.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    loaded = re.search(r'data-images-loaded="([^"]*)"', dom.stdout)
    assert loaded is not None, dom.stdout[:2000]
    assert loaded.group(1) == f"{n_imgs}/{n_imgs}", "some plots did not decode in the browser"
    for cls in EventClass:
        assert len(re.findall(rf'<tr data-class="{cls.value}"', dom.stdout)) == 3  # p50/p95/p99
    assert dom.stdout.count('<table class="routing"') == 1

    shot = tmp_path / "report-screenshot.png"
    run = _chromium(tmp_path / "profile-shot", f"--screenshot={shot}", index.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    img = imread(shot)
    assert img.shape[:2] == (2000, 1280)
    assert img.std() > 0.05, "the screenshot is blank"
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    shutil.copy(shot, artifacts / "report-screenshot.png")
