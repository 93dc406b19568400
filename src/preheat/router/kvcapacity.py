"""An instance's KV-cache capacity, read from what the engine itself publishes (pure).

* **vLLM** (and the simulated engine) export ``vllm:cache_config_info``: a gauge of 1
  whose labels are the engine's ``CacheConfig``; ``block_size`` x ``num_gpu_blocks`` is
  the number of tokens its prefix cache can hold (llm-d and the Gateway API Inference
  Extension size their per-server prefix LRU the same way).
* **llama.cpp** ``GET /props``: ``default_generation_settings.n_ctx`` is the context of
  one slot; a slot keeps one prompt's KV, so the server holds ``n_ctx x total_slots``
  tokens of cached prefix at most.

The router's health loop fetches the text/JSON (router/health.py) and hands it here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["CAPACITY_METRIC", "capacity_from_metrics", "capacity_from_props"]

CAPACITY_METRIC = "vllm:cache_config_info"
_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def capacity_from_metrics(text: str) -> int | None:
    """Tokens of KV cache from a Prometheus exposition (``None`` without the metric, or
    when its labels are missing or not positive integers)."""
    m = _LINE.search(text)
    if m is None:
        return None
    labels = dict(_LABEL.findall(m.group("labels")))
    try:
        bs = int(labels["block_size"])
        nb = int(labels["num_gpu_blocks"])
    except (KeyError, ValueError):
        return None
    return bs * nb if bs > 0 and nb > 0 else None


def capacity_from_props(doc: Any) -> int | None:
    """Tokens of KV cache from llama.cpp's ``/props`` document (context per slot x slots)."""
    if not isinstance(doc, Mapping):
        return None
    gen = doc.get("default_generation_settings")
    n_ctx = gen.get("n_ctx") if isinstance(gen, Mapping) else None
    slots = doc.get("total_slots", 1)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0:
        return None
    if isinstance(slots, bool) or not isinstance(slots, int) or slots <= 0:
        slots = 1
    return n_ctx * slots
