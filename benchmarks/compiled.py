"""Build an opt-in copy of preheat with the simulator's hot pure modules compiled by mypyc.

    .venv/bin/python benchmarks/compiled.py          # build (or reuse); prints the folder
    PYTHONPATH=$(.venv/bin/python benchmarks/compiled.py) .venv/bin/preheat sim routing ...
    .venv/bin/python benchmarks/sim_scale.py million --compiled ...

The copy lives in ``~/.cache/preheat/compiled/<hash>/`` (``<hash>``: SHA-256 of every
``.py`` under ``src/preheat``, the module list and the mypyc version), so a changed
source builds a new copy and an unchanged one is reused. Nothing about how the package
is installed or tested changes: only a process started with that folder first on
``PYTHONPATH`` runs the compiled modules (an extension module is found before the
``.py`` next to it); every other module of the copy is the plain source.

The compiled code is the same source, so results are byte-identical; a build takes a
few minutes of CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import mypy.version

SRC = Path(__file__).resolve().parent.parent / "src" / "preheat"
CACHE = Path.home() / ".cache" / "preheat" / "compiled"
# The modules a fleet simulation spends its time in (relative to src/preheat). All of
# them compile unchanged.
MODULES = (
    "kvcache.py",
    "timing.py",
    "engine/core/chat.py",
    "engine/core/scheduler.py",
    "engine/core/tokenizer.py",
    "router/prefix.py",
    "router/policies/__init__.py",
    "router/policies/base.py",
    "router/policies/hybrid.py",
    "router/policies/least_outstanding.py",
    "router/policies/predicted.py",
    "router/policies/prefix_aware.py",
    "router/policies/random.py",
    "router/policies/stable.py",
    "router/policies/stable_load.py",
    "router/policies/stable_traffic.py",
    "router/policies/stable_weights.py",
    "sim/engine.py",
    "sim/events.py",
    "sim/prompts.py",
    "sim/routing.py",
)
_MYPY_INI = "[mypy]\nignore_missing_imports = True\ncheck_untyped_defs = True\n"
_DONE = "COMPLETE"


def source_hash(src: Path = SRC) -> str:
    """The build's key: every source file, the module list and the compiler's version."""
    h = hashlib.sha256(f"{mypy.version.__version__}\n{sys.version}\n".encode())
    h.update("\n".join(MODULES).encode())
    for p in sorted(src.rglob("*.py")):
        h.update(str(p.relative_to(src)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def build(src: Path = SRC, cache: Path = CACHE, *, quiet: bool = False) -> Path:
    """The folder to put first on ``PYTHONPATH``; built if this source has none yet."""
    dest = cache / source_hash(src)
    if (dest / _DONE).exists():
        return dest
    missing = [m for m in MODULES if not (src / m).is_file()]
    if missing:
        raise SystemExit(f"modules to compile not found under {src}: {', '.join(missing)}")
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp / "preheat", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "mypy.ini").write_text(_MYPY_INI)
    mypyc = Path(sys.executable).with_name("mypyc")
    cmd = [str(mypyc), "--config-file", "mypy.ini", *(f"preheat/{m}" for m in MODULES)]
    out = subprocess.DEVNULL if quiet else sys.stderr  # stdout is the folder alone
    r = subprocess.run(cmd, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
    if r.returncode:
        raise SystemExit(f"mypyc failed (exit {r.returncode}) in {tmp}; run it there to see why")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    absent = [m for m in MODULES if not (tmp / "preheat" / m).with_suffix(suffix).is_file()]
    if absent:
        raise SystemExit(f"mypyc built no extension for: {', '.join(absent)} (in {tmp})")
    shutil.rmtree(tmp / "build", ignore_errors=True)
    (tmp / _DONE).write_text("\n".join(MODULES) + "\n")
    if dest.exists():  # another build finished first
        shutil.rmtree(tmp)
    else:
        tmp.rename(dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet", action="store_true", help="hide mypyc's output")
    args = ap.parse_args()
    print(build(quiet=args.quiet))


if __name__ == "__main__":
    main()
