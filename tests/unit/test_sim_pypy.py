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
    here, there = _both("routing", args)
    if "--kv-blocks" in args:  # the pressure run does preempt, so that path is compared
        assert json.loads(here)["preemptions"] > 0
    assert there == here


def _both(command: str, args: list[str]) -> tuple[str, str]:
    """``preheat sim COMMAND ARGS --json``'s output here, and ``pypy.py COMMAND ARGS``'s."""
    pypy = shutil.which("pypy3")
    if pypy is None:
        pytest.skip("pypy3 is not installed (scripts/install-sysdeps.sh installs it)")
    assert sys.implementation.name == "cpython"
    here = CliRunner().invoke(main, ["sim", command, *args, "--json"])
    assert here.exit_code == 0, here.output
    there = subprocess.run(
        [pypy, str(LOADER), command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert there.returncode == 0, there.stderr
    return here.output, there.stdout


# Two seeded cold-start runs over the study's models file: spot interruptions with peers,
# two replicas per node and a release rolled under `predictive`; diurnal demand with a
# short queue under `warm-all`, whose warm-ups fill the disks and evict.
MODELS = str(ROOT / "benchmarks" / "sim_coldstart_models.yaml")
COLD_RUNS = [
    ["--nodes", "12", "--nvme", "1TB", "--models", MODELS, "--pattern", "spot",
     "--cache-policy", "predictive", "--peers", "on", "--slots", "2",
     "--release", "model-01@2h", "--duration", "6h", "--seed", "3"],
    ["--nodes", "10", "--nvme", "0.5TB", "--models", MODELS, "--pattern", "diurnal",
     "--cache-policy", "warm-all", "--queue-bound", "16", "--origin-bandwidth", "40Gbps",
     "--duration", "8h", "--seed", "1"],
]  # fmt: skip


@pytest.mark.parametrize("args", COLD_RUNS, ids=["spot-peers-release", "diurnal-warm-all"])
def test_pypy_coldstart_prints_the_cpython_clis_json(args: list[str]) -> None:
    """A seeded `sim coldstart` run under pypy3 prints byte for byte the JSON of the CLI here."""
    here, there = _both("coldstart", args)
    out = json.loads(here)
    if "--release" in args:  # the rollout path is compared
        assert out["releases"] == 1 and out["classes"]["new_version"]["starts"] > 0
    else:
        assert out["evictions"] > 0 and out["queue"]["dropped"] > 0
    assert there == here
