"""The layer contract of docs/architecture.md holds (import-linter), and it would catch a break."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")

# (module file under src/preheat, line injected after ``from __future__``, expected chain)
INJECTIONS = (
    ("kvcache.py", "import time", "preheat.kvcache -> time"),
    (
        "control/plan.py",
        "import random",
        "preheat.control.plan -> random",
    ),
    (
        "telemetry/stats.py",
        "from pathlib import Path",
        "preheat.telemetry.stats -> pathlib",
    ),
    (
        "control/spec_types.py",
        "import yaml",
        "preheat.control.spec_types -> yaml",
    ),
    # A runtime import next to the TYPE_CHECKING one is still an import.
    (
        "router/policies/random.py",
        "import random as _rng_module",
        "preheat.router.policies.random -> random",
    ),
    # The back door this contract closed: a pure module importing one that writes files.
    (
        "telemetry/classify.py",
        "import preheat.telemetry.events",
        "preheat.telemetry.classify -> preheat.telemetry.events",
    ),
)


def _lint(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def test_import_contracts_kept() -> None:
    """lint-imports reports every contract kept."""
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" not in proc.stdout.lower().replace("0 broken", "")


def test_forbidden_imports_in_pure_modules_are_caught(tmp_path: Path) -> None:
    """A copy of the package with a clock, rng, path, YAML or file-writing import injected
    into pure modules breaks the pure contract, naming each module and import."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "src" / "preheat", src / "preheat", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    for rel, line, _ in INJECTIONS:
        path = src / "preheat" / rel
        text = path.read_text()
        head = "from __future__ import annotations\n"
        assert head in text, rel
        path.write_text(text.replace(head, f"{head}\n{line}\n", 1))
    proc = _lint(tmp_path, env={**os.environ, "PYTHONPATH": str(src)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Layers: imports only point down (docs/architecture.md) KEPT" in proc.stdout
    for _, _, expected in INJECTIONS:
        assert expected in proc.stdout, expected + "\n" + proc.stdout


def _contract_lists() -> dict[str, list[str]]:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    layers = parser["importlinter:contract:layers"]["layers"].split()
    pure = parser["importlinter:contract:pure"]
    return {
        "layers": [m for m in layers if m != ":"],
        "pure": pure["source_modules"].split(),
        "forbidden": pure["forbidden_modules"].split(),
    }


def test_architecture_doc_names_what_the_contract_checks() -> None:
    """docs/architecture.md names every layered module, pure module and forbidden import of
    .importlinter, and cites no design file from outside the project."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    lists = _contract_lists()
    assert len(lists["pure"]) >= 18 and "time" in lists["forbidden"]
    diagram = doc.split("```")[1]
    for module in lists["layers"]:
        assert f" {module.removeprefix('preheat.')} " in f" {diagram} ".replace("\n", " "), module
    for module in lists["pure"]:
        assert f"`{module.removeprefix('preheat.')}`" in doc, module
    for module in lists["forbidden"]:
        assert f"`{module}`" in doc, module
    for path in sorted((ROOT / "docs").glob("*.md")):
        assert "DESIGN.md" not in path.read_text(), path.name
