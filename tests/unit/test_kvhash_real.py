"""vLLM's block hashes, real tokenizer.json codecs and the kv_events setting: the router
hashes what a vLLM engine hashes, and bad settings are refused with the fix."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import cbor2
import pytest
from tokenizers import Tokenizer

from preheat.errors import ConfigError
from preheat.kvhash import external_hash, make_scheme
from preheat.router.config import parse_config
from preheat.router.kvprompt import PromptBlocks
from preheat.router.kvspec import parse_kv_events
from preheat.router.tokenize import load_codec
from preheat.testing.hftokenizer import build_snapshot


def _vllm_chain(fn: Any, seed: str, tokens: list[int], bs: int, salt: str | None) -> list[int]:
    """vLLM v1 kv_cache_utils as written there: NONE_HASH = fn(PYTHONHASHSEED),
    hash_block_tokens(parent, block, extra) = fn((parent, tuple(block), extra)), the
    salt as the first block's extra key, events carrying the digest's low 64 bits."""
    none_hash = fn(seed)
    parent = None
    out = []
    for i in range(len(tokens) // bs):
        extra = (salt,) if i == 0 and salt else None
        parent = fn((parent or none_hash, tuple(tokens[i * bs : (i + 1) * bs]), extra))
        out.append(int.from_bytes(parent, byteorder="big") & ((1 << 64) - 1))
    return out


def _cbor(x: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def _pickle(x: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@pytest.mark.parametrize(("name", "fn"), [("sha256_cbor", _cbor), ("sha256", _pickle)])
def test_vllm_schemes_equal_vllms_hash_block_tokens(name: str, fn: Any) -> None:
    """sha256_cbor and sha256 chains equal vLLM's definition, with and without a
    cache_salt, and an event's raw 32-byte hash maps to the same int key."""
    tokens = list(range(1000, 1000 + 100))
    scheme = make_scheme(name, 0)
    for salt in (None, "tenant-a"):
        assert scheme.hashes(tokens, 16, salt) == _vllm_chain(fn, "0", tokens, 16, salt)
    digest = fn((fn("0"), tuple(tokens[:16]), None))
    assert external_hash(digest) == scheme.hashes(tokens, 16)[0]


def test_unsupported_hash_and_missing_seed_are_refused_with_the_fix() -> None:
    """xxhash is named unsupported with the choices; a vLLM hash without its
    PYTHONHASHSEED says to set it."""
    with pytest.raises(ConfigError, match="sha256_cbor"):
        make_scheme("xxhash", 0)
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        make_scheme("sha256_cbor")


def test_hf_codec_chunked_hashes_equal_whole_prompt_hashes(tmp_path: Path) -> None:
    """With a real byte-level BPE tokenizer.json and a Llama-3-shaped chat template, the
    router's chunk-cached hashes equal hashing the whole rendered prompt tokenized at
    once, for chat (with tools) and completions (BOS first) bodies."""
    snap = build_snapshot(tmp_path / "model")
    codec = load_codec(snap)
    assert codec.chunking and codec.lead == (0,)
    tok = Tokenizer.from_file(str(snap / "tokenizer.json"))
    scheme = make_scheme("sha256_cbor", 0)
    pb = PromptBlocks(codec, scheme)
    doc = "the router sends each request where its prefix already is; " * 40
    bodies: list[dict[str, Any]] = [
        {
            "messages": [
                {"role": "system", "content": "answer"},
                {"role": "user", "content": doc + "q1"},
            ]
        },
        {"messages": [{"role": "user", "content": doc + "q2"}], "tools": [{"name": "f"}]},
        {"prompt": doc + "def main(): return 42"},
    ]
    for body in bodies:
        if "messages" in body:
            text = codec.render(body["messages"], body.get("tools"))
            assert text is not None and text.startswith("<|begin_of_text|>")
            ids = tok.encode(text, add_special_tokens=False).ids
        else:
            ids = tok.encode(body["prompt"], add_special_tokens=True).ids
        assert pb.blocks(body) == (scheme.hashes(ids, 16), len(ids))
    assert pb.blocks(bodies[0]) is not None and pb.hits > 0
    assert codec.render([{"role": "wizard", "content": "x"}]) is None  # raise_exception


def test_kv_events_settings_parse_to_one_string_and_bad_ones_name_the_fix(tmp_path: Path) -> None:
    """A mapping setting round-trips through its one-string form and the router config;
    a missing tokenizer.json, an unknown field and a bad endpoint are refused."""
    snap = build_snapshot(tmp_path / "model")
    spec = parse_kv_events(
        {
            "endpoint": "tcp://127.0.0.1:5557",
            "replay": "tcp://127.0.0.1:5558",
            "tokenizer": str(snap),
            "hash": "sha256_cbor",
            "hash_seed": 0,
        },
        where="t",
    )
    assert parse_kv_events(spec.canonical(), where="t") == spec
    cfg = parse_config(
        {
            "variants": [
                {
                    "name": "v",
                    "instances": [
                        {
                            "url": "http://h:1",
                            "kv_events": {
                                "endpoint": "tcp://127.0.0.1:5557",
                                "tokenizer": str(snap),
                                "hash_seed": "7",
                            },
                        }
                    ],
                }
            ]
        }
    )
    ev = dict(cfg.variants[0].kv_events)["http://h:1"]
    assert parse_kv_events(ev, where="t").hash == "sha256" and "hash_seed=7" in ev
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        parse_kv_events({"endpoint": "tcp://127.0.0.1:1", "tokenizer": str(tmp_path)}, where="t")
    with pytest.raises(ConfigError, match="unknown kv_events field"):
        parse_kv_events({"endpoint": "tcp://127.0.0.1:1", "tokeniser": "x"}, where="t")
    with pytest.raises(ConfigError, match=r"tcp://127\.0\.0\.1:5557"):
        parse_kv_events({"endpoint": "udp://x:1"}, where="t")
