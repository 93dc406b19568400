"""An instance's KV-events setting: where it publishes and how its engine hashes prompts.

In the router config (``kv_events`` per instance) or ``--kv-events URL=VALUE``::

    kv_events: tcp://10.0.0.5:5557                       # the simulated engine
    kv_events:                                           # a vLLM engine
      endpoint: tcp://10.0.0.5:5557   # its --kv-events-config "endpoint"
      replay: tcp://10.0.0.5:5558     # its "replay_endpoint" (optional; late joins)
      tokenizer: /var/lib/preheat/snapshots/llama-3.1-8b   # the snapshot dir or its tokenizer.json
      hash: sha256_cbor               # its --prefix-caching-hash-algo (default sha256)
      hash_seed: "0"                  # its PYTHONHASHSEED
      block_size: 16                  # its --block-size

The same setting as one string (what ``GET /admin/config`` shows and the CLI takes):
``tcp://10.0.0.5:5557?tokenizer=/path&hash=sha256_cbor&hash_seed=0&replay=tcp://...``.
Defaults: ``tokenizer: engine`` (the simulated engine's own), which implies ``hash:
builtin``; a path implies ``hash: sha256`` (vLLM's default). Errors name the field and
the fix: a missing tokenizer.json, an unknown hash, a vLLM hash without its seed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from preheat.errors import ConfigError
from preheat.kvhash import make_scheme
from preheat.router.kvprompt import EngineCodec, PromptBlocks

__all__ = [
    "OPTION_KEYS",
    "KVEventsSpec",
    "PromptCache",
    "parse_kv_events",
    "parse_kv_events_options",
    "prompt_blocks",
]

_KEYS = ("endpoint", "replay", "tokenizer", "hash", "hash_seed", "block_size")
#: The fields ``kv_events_options`` may set for every instance at once: how the engines
#: hash prompts. The endpoints are each instance's own.
OPTION_KEYS = ("tokenizer", "hash", "hash_seed", "block_size")


def _endpoint(value: Any, *, where: str, field: str) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    try:
        ok = parts is not None and parts.scheme == "tcp" and bool(parts.hostname) and parts.port
    except ValueError:
        ok = False
    if not ok or parts is None or parts.path not in ("", "/"):
        raise ConfigError(
            f"{where}: kv_events {field} {value!r} is not a ZMQ endpoint like tcp://127.0.0.1:5557"
        )
    return f"tcp://{parts.netloc}"


@dataclass(frozen=True, slots=True)
class KVEventsSpec:
    """One instance's KV-event publisher and prompt hashing (see the module header)."""

    endpoint: str
    replay: str | None = None
    tokenizer: str = "engine"
    hash: str = "builtin"
    hash_seed: str | None = None
    block_size: int = 16

    def canonical(self, explicit: Collection[str] = ()) -> str:
        """The one-string form; the plain endpoint when everything else is the default.
        Fields named in ``explicit`` (those ``kv_events_options`` set) are written even at
        their default, so that the options cannot override them when it is read again."""
        q: dict[str, str] = {}
        if self.replay:
            q["replay"] = self.replay
        if self.tokenizer != "engine" or "tokenizer" in explicit:
            q["tokenizer"] = self.tokenizer
        if self.hash != ("builtin" if self.tokenizer == "engine" else "sha256") or (
            "hash" in explicit
        ):
            q["hash"] = self.hash
        if self.hash_seed is not None:
            q["hash_seed"] = self.hash_seed
        if self.block_size != 16 or "block_size" in explicit:
            q["block_size"] = str(self.block_size)
        return self.endpoint + ("?" + urlencode(q, safe=":/") if q else "")


def parse_kv_events_options(value: Any, *, where: str = "kv_events_options") -> dict[str, str]:
    """Validate ``kv_events_options`` (a mapping, or ``key=value&...`` as the CLI takes it):
    defaults for every instance's ``kv_events`` fields ``OPTION_KEYS``, which an
    instance's own setting overrides. Returns them as strings, checked together (a vLLM
    hash needs its seed, a tokenizer path its tokenizer.json)."""
    if isinstance(value, str):
        text = value.lstrip("?&")
        if any(part and "=" not in part for part in text.split("&")):
            raise ConfigError(
                f"{where} {value!r} is not key=value pairs joined by '&', e.g. "
                "hash=sha256_cbor&hash_seed=0&tokenizer=/models/snap"
            )
        raw: dict[str, Any] = dict(parse_qsl(text, keep_blank_values=True))
    elif isinstance(value, Mapping):
        raw = dict(value)
    else:
        raise ConfigError(f"{where} {value!r} must be a mapping of {', '.join(OPTION_KEYS)}")
    for key in raw:
        if key in ("endpoint", "replay"):
            raise ConfigError(
                f"{where}: {key} is each instance's own; give it in the instance's kv_events "
                "(or, in Kubernetes, as the slice's kv-events / kv-replay port)"
            )
        if key not in OPTION_KEYS:
            raise ConfigError(
                f"{where}: unknown key {key!r}; known: {', '.join(OPTION_KEYS)}"
                + ("; the silence timeout is kv_events_silence_s" if key == "silence_s" else "")
            )
    out = {k: str(raw[k]) for k in OPTION_KEYS if k in raw and raw[k] is not None}
    parse_kv_events({"endpoint": "tcp://127.0.0.1:1", **out}, where=where)  # values checked
    return out


def parse_kv_events(
    value: Any, *, where: str, options: Mapping[str, str] | None = None
) -> KVEventsSpec:
    """Validate a ``kv_events`` value: an endpoint string (with options) or a mapping;
    ``options`` (``parse_kv_events_options``) fill the fields it does not set."""
    if isinstance(value, str):
        head, _, query = value.partition("?")
        raw: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
        raw["endpoint"] = head.rstrip("/")
    elif isinstance(value, Mapping):
        raw = dict(value)
    else:
        raise ConfigError(
            f"{where}: kv_events {value!r} must be tcp://host:port or a mapping with endpoint"
        )
    if options:
        raw = {**options, **raw}
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown kv_events field(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}"
        )
    endpoint = _endpoint(raw.get("endpoint"), where=where, field="endpoint")
    replay = raw.get("replay")
    replay = _endpoint(replay, where=where, field="replay") if replay not in (None, "") else None
    tok = raw.get("tokenizer", "engine")
    if not isinstance(tok, str) or not tok:
        raise ConfigError(f"{where}: kv_events tokenizer {tok!r} must be 'engine' or a path")
    if tok != "engine":
        p = Path(tok)
        if not (p / "tokenizer.json").is_file() and not (p.is_file() and p.name.endswith(".json")):
            raise ConfigError(
                f"{where}: kv_events tokenizer {tok!r} has no tokenizer.json; give the model's "
                "snapshot directory or its tokenizer.json, or tokenizer: engine"
            )
    algo = raw.get("hash", "builtin" if tok == "engine" else "sha256")
    seed = raw.get("hash_seed")
    seed = None if seed is None or seed == "" else str(seed)
    make_scheme(str(algo), seed, where=f"{where}: kv_events")  # validates name and seed
    bs = raw.get("block_size", 16)
    try:
        bs = int(bs)
    except (TypeError, ValueError):
        bs = 0
    if not 1 <= bs <= 1024:
        raise ConfigError(f"{where}: kv_events block_size {raw.get('block_size')!r} must be 1-1024")
    return KVEventsSpec(endpoint, replay, tok, str(algo), seed, bs)


PromptCache = dict[tuple[str, str, str | None, int], PromptBlocks]


def prompt_blocks(spec: KVEventsSpec, cache: PromptCache) -> PromptBlocks:
    """The prompt -> block hashes computation of instances with this setting, shared
    through ``cache`` (the subscriber's) by every instance that has the same one."""
    key = (spec.tokenizer, spec.hash, spec.hash_seed, spec.block_size)
    pb = cache.get(key)
    if pb is None:
        if spec.tokenizer == "engine":
            codec: Any = EngineCodec()
        else:
            from preheat.router.tokenize import load_codec

            codec = load_codec(spec.tokenizer)
        pb = PromptBlocks(codec, make_scheme(spec.hash, spec.hash_seed), spec.block_size)
        cache[key] = pb
    return pb
