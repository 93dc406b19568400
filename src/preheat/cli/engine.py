"""``preheat engine``: run the simulated OpenAI-compatible inference engine."""

from __future__ import annotations

import time
from pathlib import Path

import click

from preheat.timing import PROFILES


@click.group()
def engine() -> None:
    """The simulated inference engine (vLLM-like timing, real prefix KV cache)."""


@engine.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    default="tiny",
    show_default=True,
    help="Timing profile (hardware x model): step times, context length, KV capacity.",
)
@click.option(
    "--snapshot",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Directory of weight files; every byte is read before /health turns 200.",
)
@click.option(
    "--kv-blocks",
    type=click.IntRange(1),
    help="KV cache capacity in blocks of 16 tokens (default: the profile's).",
)
@click.option(
    "--time-scale",
    type=click.FloatRange(0.0),
    default=1.0,
    show_default=True,
    help="Multiply every step's sleep: 0.01 runs 100x faster, 0 never sleeps.",
)
@click.option(
    "--max-num-seqs",
    type=click.IntRange(1),
    help="Most sequences running at once (default: the profile's).",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(1),
    help="Token budget per step for chunked prefill (default: the profile's).",
)
@click.option("--model-name", help="Served model name (default: the profile's model).")
@click.option(
    "--no-prefix-caching", is_flag=True, help="Disable prefix caching (every prompt is cold)."
)
@click.option(
    "--warmup-seconds",
    type=click.FloatRange(0.0),
    default=0.0,
    show_default=True,
    help="Simulated runtime warm-up after the weights are read and before /health is OK "
    "(vLLM: KV allocation, CUDA graphs); scaled by --time-scale.",
)
@click.option(
    "--kv-events",
    metavar="tcp://127.0.0.1:PORT",
    help="Publish KV-cache events in vLLM's format (ZMQ PUB bound at this endpoint: "
    "BlockStored, BlockRemoved, AllBlocksCleared); off by default.",
)
@click.option(
    "--kv-events-pod",
    help="The <pod> part of the event topic kv@<pod>@<model> (default: host:port).",
)
def serve(
    host: str,
    port: int,
    profile: str,
    snapshot: Path | None,
    kv_blocks: int | None,
    time_scale: float,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    model_name: str | None,
    no_prefix_caching: bool,
    warmup_seconds: float,
    kv_events: str | None,
    kv_events_pod: str | None,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /startup, /metrics.

    \b
    Example:
      preheat engine serve --port 8001 --profile llama-3.1-70b-8xh100 --time-scale 0.01
      curl -s localhost:8001/v1/completions -H 'content-type: application/json' \\
           -d '{"prompt": "Hello", "max_tokens": 8}'
    """
    started = time.time()
    if kv_events is not None and not kv_events.startswith(("tcp://", "ipc://")):
        raise click.BadParameter(
            f"{kv_events!r} is not a ZMQ endpoint; give tcp://127.0.0.1:5557",
            param_hint="--kv-events",
        )
    from preheat.engine.config import EngineConfig
    from preheat.engine.server import run

    run(
        EngineConfig(
            profile=PROFILES[profile],
            host=host,
            port=port,
            model_name=model_name,
            snapshot=snapshot,
            kv_blocks=kv_blocks,
            time_scale=time_scale,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=not no_prefix_caching,
            warmup_s=warmup_seconds,
            runtime_started=started,
            kv_events=kv_events,
            kv_events_pod=kv_events_pod,
        )
    )


@engine.command("profiles")
def profiles() -> None:
    """List the timing profiles with their headline figures."""
    for p in PROFILES.values():
        click.echo(
            f"{p.name:24} {p.model:36} {p.hardware:28} "
            f"prefill {p.prefill_tokens_per_s:>8,.0f} tok/s  "
            f"TPOT@1 {p.decode_step_time(1, 1000) * 1e3:5.1f} ms  "
            f"KV {p.kv_capacity_tokens:>9,} tokens  ctx {p.max_model_len:,}"
        )
