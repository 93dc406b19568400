"""The simulated engine's settings: what ``preheat engine serve`` accepts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from preheat.timing import EngineProfile

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``preheat engine serve`` accepts; validated by the CLI."""

    profile: EngineProfile
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    """Served model name; default: the profile's model."""
    snapshot: Path | None = None
    """A directory of weight files to read completely before turning healthy."""
    kv_blocks: int | None = None
    time_scale: float = 1.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    enable_prefix_caching: bool = True
    warmup_s: float = 0.0
    """Simulated runtime warm-up between weights_loaded and healthy (KV allocation, CUDA
    graph capture: tens of seconds in vLLM); scaled by ``time_scale`` like every step."""
    runtime_started: float | None = None
    """Epoch time the process started; default: when the server object is made."""
    kv_events: str | None = None
    """Publish KV-cache events as vLLM does (ZMQ PUB bound here, e.g. tcp://127.0.0.1:5557,
    with ``?hash=...&hash_seed=...&replay=tcp://...`` options; engine/kvevents.py); None: off."""
    kv_events_pod: str | None = None
    """The ``<pod>`` of the event topic ``kv@<pod>@<model>``; default host:port."""

    @property
    def served_model(self) -> str:
        return self.model_name or self.profile.model
