"""The router learns each engine's KV capacity from the engine's own /metrics (real
processes on 127.0.0.1: simulated engines and a router)."""

from __future__ import annotations

import time
import urllib.request

from preheat.testing.engines import simulated_engines
from preheat.testing.routers import launch_router


def _metric(url: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            inst = labels.split('instance="')[1].split('"')[0]
            out[inst] = float(value)
    return out


def test_the_router_learns_each_engines_kv_capacity_from_cache_config_info() -> None:
    """Two engines with 600 and 900 KV blocks: the router exports 9,600 and 14,400
    tokens of capacity for them, read from vllm:cache_config_info before traffic."""
    with simulated_engines(1, kv_blocks=600) as small, simulated_engines(1, kv_blocks=900) as big:
        urls = [small[0].url, big[0].url]
        r = launch_router(backends=urls, strategy="prefix_aware")
        try:
            deadline = time.monotonic() + 20
            caps: dict[str, float] = {}
            while time.monotonic() < deadline:
                caps = _metric(r.url, "preheat_router_kv_capacity_tokens")
                if len(caps) == 2:
                    break
                time.sleep(0.2)
            assert caps == {urls[0]: 9600.0, urls[1]: 14400.0}
        finally:
            r.stop()
