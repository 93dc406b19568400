"""Run the fleet simulator on PyPy (Debian's ``pypy3``, Python 3.9), opt-in, for speed.

    pypy3 benchmarks/pypy.py routing --instances 4 --profile tiny --policy prefix_aware \\
        --workload aws-8k --requests 200 --concurrency 8 --seed 3
    pypy3 benchmarks/pypy.py benchmarks/sim_scale.py million --requests 1000000
    .venv/bin/python benchmarks/sim_scale.py million --requests 1000000 --pypy   # the same

The package targets Python 3.11 and is installed and tested on CPython; nothing about
that changes. The simulator's code (policies, prefix key, KV cache, scheduler, timing,
sim) is plain Python that PyPy's JIT runs 2-4x faster, except for a few 3.10/3.11
spellings that Python 3.9 cannot evaluate. The runtime unions in ``isinstance`` are
written as tuples in the source (valid on both); what cannot be written both ways is
patched here, before ``preheat`` is imported, and only on an interpreter older than 3.11:

* ``@dataclass(slots=True)``: 3.9's ``dataclass`` has no ``slots``; it is dropped (the
  classes get a ``__dict__``; PyPy's instances are compact either way, and no code
  depends on the absence of ``__dict__``);
* ``class Choice(NamedTuple, Generic[T])``: 3.9's ``NamedTuple`` refuses other bases;
  the generic base only serves the type checker, so it is left out at run time;
* ``bisect``'s ``key=`` (3.10): the four functions take it, as 3.10's do (without it,
  the C originals run);
* ``enum.StrEnum`` (3.11): a ``str`` enum whose ``str()`` and ``format()`` are its value
  and whose ``auto()`` is the lower-cased name, as in 3.11.

Type aliases that are unions of classes (``control.spec_types.EngineSpec``,
``control.state.Action``) are quoted in the source, so importing them evaluates no
``X | Y``; run-time code reads ``control.state.ACTION_TYPES``.

``routing`` and ``coldstart`` mirror ``preheat sim routing --json`` and ``preheat sim
coldstart --json`` (the CLI itself needs click and rich, which PyPy's Debian package does
not have) and print the same JSON objects; ``tests/unit/test_sim_pypy.py`` runs them
under ``pypy3`` and compares them byte for byte with the CLI on CPython. Any other first
argument is a script run with the patches on.

    pypy3 benchmarks/pypy.py coldstart --nodes 100 --nvme 3TB \\
        --models benchmarks/sim_coldstart_models.yaml --pattern diurnal --cache-policy lru \\
        --origin-bandwidth 40Gbps --peers on --duration 36h --seed 1
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import enum
import json
import random
import runpy
import sys
import typing
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"


def install() -> None:
    """Patch what Python < 3.11 lacks for preheat's simulator (nothing on 3.11+)."""
    if hasattr(enum, "StrEnum"):  # 3.11 or later: everything below is there
        return
    orig = dataclasses.dataclass

    def dataclass(cls: Any = None, /, **kw: Any) -> Any:
        kw.pop("slots", None)
        if cls is None:
            return lambda c: orig(c, **kw)
        return orig(cls, **kw)

    dataclasses.dataclass = dataclass  # type: ignore[assignment]
    nt: Any = typing.NamedTuple
    nt.__mro_entries__ = lambda bases: (typing._NamedTuple,)  # type: ignore[attr-defined]
    _bisect_with_key()

    class StrEnum(str, enum.Enum):  # noqa: UP042 (the stand-in for 3.11's enum.StrEnum)
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)

        def _generate_next_value_(name: str, start: int, count: int, last: list[Any]) -> str:  # type: ignore[override]
            return name.lower()

    enum.StrEnum = StrEnum  # type: ignore[misc]


def _bisect_with_key() -> None:
    """``bisect``'s functions with 3.10's ``key=``: the key applies to the list's items."""
    c_left, c_right = bisect.bisect_left, bisect.bisect_right

    def bisect_left(a: Any, x: Any, lo: int = 0, hi: Any = None, *, key: Any = None) -> int:
        if key is None:
            return c_left(a, x, lo, len(a) if hi is None else hi)
        hi = len(a) if hi is None else hi
        while lo < hi:
            mid = (lo + hi) // 2
            if key(a[mid]) < x:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def bisect_right(a: Any, x: Any, lo: int = 0, hi: Any = None, *, key: Any = None) -> int:
        if key is None:
            return c_right(a, x, lo, len(a) if hi is None else hi)
        hi = len(a) if hi is None else hi
        while lo < hi:
            mid = (lo + hi) // 2
            if x < key(a[mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def insort_left(a: Any, x: Any, lo: int = 0, hi: Any = None, *, key: Any = None) -> None:
        a.insert(bisect_left(a, x if key is None else key(x), lo, hi, key=key), x)

    def insort_right(a: Any, x: Any, lo: int = 0, hi: Any = None, *, key: Any = None) -> None:
        a.insert(bisect_right(a, x if key is None else key(x), lo, hi, key=key), x)

    bisect.bisect_left, bisect.bisect_right, bisect.bisect = bisect_left, bisect_right, bisect_right
    bisect.insort_left, bisect.insort_right, bisect.insort = insort_left, insort_right, insort_right


def routing(argv: list[str]) -> str:
    """``preheat sim routing ... --json`` without click: the same run, the same JSON."""
    from preheat.bench.workloads import WORKLOADS
    from preheat.router.policies import PolicyParams
    from preheat.sim.routing import RoutingConfig, SimItem, simulate_routing
    from preheat.sim.trace import parse_trace
    from preheat.timing import PROFILES

    d = PolicyParams()
    ap = argparse.ArgumentParser(prog="pypy.py routing")
    ap.add_argument("--instances", type=int, required=True)
    ap.add_argument("--profile", choices=sorted(PROFILES), required=True)
    ap.add_argument("--kv-blocks", type=int)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--placement", default=d.placement)
    ap.add_argument("--workload")
    ap.add_argument("--set", dest="settings", action="append", default=[])
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--rate", type=float)
    ap.add_argument("--prefix-length", type=int, default=d.prefix_length)
    ap.add_argument("--threshold", type=int, default=d.concurrency_threshold)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if (a.workload is None) == (a.trace is None):
        ap.error("give exactly one of --workload NAME or --trace FILE")
    if a.trace is not None:
        items = parse_trace(a.trace.read_text().splitlines(), where=str(a.trace))
        items = items[: a.requests] if a.requests else items
    else:
        params: dict[str, int | float] = {}
        for pair in a.settings:  # KEY=NUMBER, read as preheat.cli.sim.workload_args does
            key, _, value = pair.partition("=")
            params[key] = float(value) if "." in value or "e" in value else int(value)
        work = WORKLOADS[a.workload](a.requests or 1000, seed=a.seed, **params)
        items = [SimItem(w.request_id, w.path, w.body, w.after) for w in work]
    cfg = RoutingConfig(
        instances=a.instances,
        profile=PROFILES[a.profile],
        policy=a.policy,
        params=PolicyParams(
            prefix_length=a.prefix_length,
            concurrency_threshold=a.threshold,
            placement=a.placement,
        ),
        kv_blocks=a.kv_blocks,
        concurrency=a.concurrency,
        rate=a.rate,
    )
    result = simulate_routing(
        items, cfg, policy_rng=random.Random(a.seed), arrival_rng=random.Random(a.seed + 1)
    )
    return json.dumps(result.summary())


def coldstart(argv: list[str]) -> str:
    """``preheat sim coldstart ... --json`` without click: the same run, the same JSON."""
    from preheat.errors import ConfigError
    from preheat.sim.coldstart import simulate
    from preheat.sim.coldstart_config import CACHE_POLICIES, WARM_BUDGET
    from preheat.sim.coldstart_files import prepare
    from preheat.sim.traffic import PATTERNS

    ap = argparse.ArgumentParser(prog="pypy.py coldstart")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--pattern", choices=PATTERNS)
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--cache-policy", choices=CACHE_POLICIES, required=True)
    ap.add_argument("--origin-bandwidth", default="10Gbps")
    ap.add_argument("--node-bandwidth", default="25Gbps")
    ap.add_argument("--registry-bandwidth", default="10Gbps")
    ap.add_argument("--queue-bound", type=int)
    ap.add_argument("--peers", choices=["on", "off"], default="off")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--warm-budget", default=WARM_BUDGET)
    ap.add_argument("--release", dest="releases", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration")
    a = ap.parse_args(argv)
    if a.queue_bound is not None and a.queue_bound < 0:
        ap.error(f"--queue-bound {a.queue_bound} is below 0")
    try:
        setup, rng = prepare(
            nodes=a.nodes,
            nvme=a.nvme,
            models=a.models,
            policy=a.cache_policy,
            pattern=a.pattern,
            trace=a.trace,
            origin_bandwidth=a.origin_bandwidth,
            node_bandwidth=a.node_bandwidth,
            registry_bandwidth=a.registry_bandwidth,
            queue_bound=a.queue_bound,
            peers=a.peers == "on",
            slots=a.slots,
            warm_budget=a.warm_budget,
            releases=tuple(a.releases),
            seed=a.seed,
            duration=a.duration,
        )
    except ConfigError as exc:
        ap.error(str(exc))
    return json.dumps(simulate(setup, rng).to_dict(), sort_keys=True)


COMMANDS = {"routing": routing, "coldstart": coldstart}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    install()
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    command = COMMANDS.get(sys.argv[1])
    if command is not None:
        print(command(sys.argv[2:]))
        return
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
