"""Generated sample models: safetensors shards of seeded pseudo-random bytes, written fast.

``generate_model(dir, total_bytes, shards, seed)`` writes ``model-0000i-of-0000n.safetensors``
shards (8-byte little-endian header length, JSON header with dtype/shape/data_offsets,
then the tensor bytes), ``model.safetensors.index.json`` and ``config.json``. The bytes
are a seeded random block read at seeded offsets, so generation runs at disk speed while
two seeds (or two shards) never share content. ``rewrite_shard`` replaces one shard with
new bytes of the same size: a "new revision that changes 1 of 8 shards".
``write_http_manifest(dir)`` writes the ``preheat-manifest.json`` an HTTP origin serves.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from preheat.artifacts.manifest import FileEntry, Manifest
from preheat.artifacts.refs import MANIFEST_NAME

_BLOCK = 64 << 20  # random base block per shard
_PIECE = 8 << 20  # bytes written per call
_TENSOR = 64 << 20  # bytes per tensor in a shard
_ROW = 4096  # bf16 columns per tensor row (8 KiB rows)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _header(size: int) -> tuple[bytes, int]:
    """A safetensors header for a file of exactly ``size`` bytes; returns (prefix, data_len).

    The data is bf16 tensors of up to 64 MiB (8 KiB rows) plus one u8 tensor for any tail;
    the JSON header is padded with spaces (as the format allows) to a multiple of 8 bytes.
    """
    slack = 256 + 160 * (size // _TENSOR + 2)
    while True:
        slack += -slack % 8
        data_bytes = max(0, size - 8 - slack)
        tensors: dict[str, object] = {"__metadata__": {"format": "pt", "generator": "preheat"}}
        row_bytes = _ROW * 2
        off = 0
        i = 0
        while off < data_bytes:
            n = min(_TENSOR, data_bytes - off)
            if n >= row_bytes:
                n -= n % row_bytes
                entry = {"dtype": "BF16", "shape": [n // row_bytes, _ROW]}
            else:
                entry = {"dtype": "U8", "shape": [n]}
            entry["data_offsets"] = [off, off + n]
            tensors[f"layers.{i}.weight"] = entry
            off += n
            i += 1
        raw = json.dumps(tensors, separators=(",", ":")).encode()
        if len(raw) <= slack:
            raw += b" " * (slack - len(raw))
            return struct.pack("<Q", len(raw)) + raw, data_bytes
        slack = len(raw) + 64


def _write_shard(path: Path, size: int, seed: int, shard: int) -> None:
    """Write one shard of exactly ``size`` bytes (header included)."""
    prefix, data_len = _header(size)
    rng = np.random.Generator(np.random.SFC64([seed, shard, 0x9E3779B9]))
    block = rng.random(size=(_BLOCK + _PIECE) // 8).view(np.uint8).tobytes()
    view = memoryview(block)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, prefix)
        left = data_len
        while left:
            n = min(_PIECE, left)
            start = int(rng.integers(0, _BLOCK))
            left -= os.write(fd, view[start : start + n])
    finally:
        os.close(fd)
    os.replace(tmp, path)


def generate_model(dir: Path, total_bytes: int, shards: int, seed: int = 0) -> list[Path]:
    """Write a sample safetensors model whose shards add up to exactly ``total_bytes``.

    Returns every file written (shards first, then the index and config.json).
    """
    if shards < 1:
        raise ValueError(f"shards {shards} must be >= 1")
    if total_bytes < shards * 1024:
        raise ValueError(f"total_bytes {total_bytes} is too small for {shards} shards")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    per = total_bytes // shards
    paths = []
    weight_map: dict[str, str] = {}
    for i in range(shards):
        p = dir / _shard_name(i, shards)
        _write_shard(p, per + (total_bytes - per * shards if i == shards - 1 else 0), seed, i)
        paths.append(p)
        for name in _tensor_names(p):
            weight_map[f"shard{i}.{name}"] = p.name
    index = dir / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
    )
    config = dir / "config.json"
    config.write_text(
        json.dumps(
            {
                "architectures": ["PreheatSampleForCausalLM"],
                "model_type": "preheat-sample",
                "torch_dtype": "bfloat16",
                "hidden_size": _ROW,
                "preheat_seed": seed,
            },
            indent=1,
        )
    )
    return [*paths, index, config]


def _tensor_names(path: Path) -> list[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def read_safetensors_header(path: Path) -> dict[str, object]:
    """The JSON header of a safetensors file (what an engine reads first)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return dict(json.loads(f.read(n)))


def shard_paths(dir: Path) -> list[Path]:
    return sorted(Path(dir).glob("model-*-of-*.safetensors"))


def rewrite_shard(dir: Path, index: int, seed: int) -> Path:
    """Replace shard ``index`` (0-based) with new bytes of the same size; other shards stay."""
    shards = shard_paths(dir)
    if not 0 <= index < len(shards):
        raise ValueError(f"shard index {index} is not in 0..{len(shards) - 1}")
    p = shards[index]
    size = p.stat().st_size
    _write_shard(p, size, seed + 1_000_003, index)
    return p


def write_http_manifest(dir: Path, *, revision: str | None = None) -> Path:
    """Hash every file under ``dir`` and write ``dir/preheat-manifest.json``; returns its path."""
    dir = Path(dir)
    entries = []
    for p in sorted(dir.rglob("*")):
        if not p.is_file() or p.is_symlink() or p.name == MANIFEST_NAME:
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        entries.append(FileEntry(p.relative_to(dir).as_posix(), p.stat().st_size, h.hexdigest()))
    out = dir / MANIFEST_NAME
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(Manifest(tuple(entries)).to_json(revision=revision))
    os.replace(tmp, out)
    return out
