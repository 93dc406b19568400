"""The sample model generator: exact sizes, valid safetensors headers, seeded content."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from preheat.artifacts.manifest import Manifest
from preheat.bench.models import (
    generate_model,
    read_safetensors_header,
    rewrite_shard,
    shard_paths,
    write_http_manifest,
)

MiB = 1 << 20


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in shard_paths(d)}


def test_shards_add_up_and_headers_are_valid(tmp_path: Path) -> None:
    """Shards sum to total_bytes exactly and each header describes the data that follows."""
    files = generate_model(tmp_path / "m", 3 * MiB + 5, 3, seed=7)
    shards = shard_paths(tmp_path / "m")
    assert len(shards) == 3 and files[:3] == shards
    assert sum(p.stat().st_size for p in shards) == 3 * MiB + 5
    for p in shards:
        header = read_safetensors_header(p)
        (n,) = struct.unpack("<Q", p.read_bytes()[:8])
        assert (8 + n) % 8 == 0
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]  # type: ignore[index]
        assert 8 + n + max(ends) == p.stat().st_size
    assert json.loads((tmp_path / "m" / "config.json").read_text())["preheat_seed"] == 7


def test_seeds_differ_and_rewrite_changes_one_shard(tmp_path: Path) -> None:
    """Two seeds give different bytes; rewrite_shard changes exactly one shard, same size."""
    generate_model(tmp_path / "a", 2 * MiB, 4, seed=1)
    generate_model(tmp_path / "b", 2 * MiB, 4, seed=2)
    a, b = _digests(tmp_path / "a"), _digests(tmp_path / "b")
    assert not set(a.values()) & set(b.values())
    assert len(set(a.values())) == 4
    size = shard_paths(tmp_path / "a")[2].stat().st_size
    p = rewrite_shard(tmp_path / "a", 2, seed=1)
    after = _digests(tmp_path / "a")
    assert [k for k in a if a[k] != after[k]] == [p.name] and p.stat().st_size == size


def test_http_manifest_lists_every_file(tmp_path: Path) -> None:
    """write_http_manifest hashes every file (not itself) into a valid manifest."""
    files = generate_model(tmp_path / "m", 1 * MiB, 2)
    out = write_http_manifest(tmp_path / "m")
    m = Manifest.from_json(out.read_text())
    assert {f.path for f in m.files} == {p.name for p in files}
    for f in m.files:
        assert f.sha256 == hashlib.sha256((tmp_path / "m" / f.path).read_bytes()).hexdigest()
