"""The fleet simulator on PyPy (``benchmarks/pypy.py``) gives the CPython CLI's exact JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat.cli import main

ROOT = Path(__file__).resolve().parents[2]
LOADER = ROOT / "benchmarks" / "pypy.py"

# Two seeded runs that reach most of the simulator: KV pressure with preemptions under
# the default `stable` placement (closed loop), and multi-turn chat arriving open loop
# under `learned` placement.
RUNS = [
    ["--instances", "3", "--profile", "tiny", "--policy", "prefix_aware", "--workload", "rag",
     "--requests", "150", "--kv-blocks", "300", "--concurrency", "12", "--seed", "4"],
    ["--instances", "4", "--profile", "llama-3.1-70b-8xh100", "--policy", "prefix_aware",
     "--placement", "learned", "--workload", "chat", "--requests", "120", "--rate", "40",
     "--seed", "7"],
]  # fmt: skip


@pytest.mark.parametrize("args", RUNS, ids=["rag-kv-pressure", "chat-open-loop"])
def test_pypy_run_prints_the_cpython_clis_json(args: list[str]) -> None:
    """A seeded `sim routing` run under pypy3 prints byte for byte the JSON of the CLI here."""
    pypy = shutil.which("pypy3")
    if pypy is None:
        pytest.skip("pypy3 is not installed (scripts/install-sysdeps.sh installs it)")
    assert sys.implementation.name == "cpython"
    here = CliRunner().invoke(main, ["sim", "routing", *args, "--json"])
    assert here.exit_code == 0, here.output
    there = subprocess.run(
        [pypy, str(LOADER), "routing", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert there.returncode == 0, there.stderr
    if "--kv-blocks" in args:  # the pressure run does preempt, so that path is compared
        assert json.loads(here.output)["preemptions"] > 0
    assert there.stdout == here.output
