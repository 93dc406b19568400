"""complete_manifest: the snapshot digest before any pull, for origins without sha256s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from preheat.errors import ConfigError
from preheat.runtime.nodestore import open_source
from preheat.sources.completion import complete_manifest
from preheat.store import NodeStore


def _complete(ref: str, **kw: int) -> str:
    async def go() -> str:
        src = open_source(ref)
        try:
            res = await src.resolve()
            assert not res.manifest.complete  # file:// lists no sha256
            return (await complete_manifest(src, res, **kw)).digest
        finally:
            await src.aclose()

    return asyncio.run(go())


def test_the_completed_digest_is_the_one_the_store_gives_the_snapshot(tmp_path: Path) -> None:
    """A file:// model (no sha256 at the origin) gets, before any pull, the manifest digest
    the node store names its snapshot with after the pull."""
    model = tmp_path / "m"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_bytes(b'{"hidden_size": 8}')
    (model / "sub" / "w.bin").write_bytes(bytes(range(256)) * 100)
    digest = _complete(f"file://{model}")
    pulled = NodeStore(tmp_path / "store").pull(f"file://{model}")
    assert pulled.snapshot.name == digest


def test_more_unhashed_bytes_than_the_limit_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """Over the limit of bytes to hash, the error names the size and asks for sha256s."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.bin").write_bytes(b"x" * 5000)
    with pytest.raises(ConfigError, match=r"5000 bytes, over the 4096 .*preheat-manifest.json"):
        _complete(f"file://{tmp_path / 'm'}", limit=4096)


def test_cache_names_of_hf_revisions_are_dns_names() -> None:
    """An hf:<commit> revision (with or without a filter suffix) gives a valid, distinct
    ModelDataCache name; a sha256 revision keeps its 12 hex as before."""
    import re

    from preheat.runtime.kubernetes.workload import cache_name

    commit = "4407002f5e9aeeb2414673774a87ef9634f4cb86"
    names = {cache_name("chat", f"hf:{commit}"), cache_name("chat", f"hf:{commit}+f1a2")}
    assert len(names) == 2
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) for n in names), names
    assert cache_name("chat", "sha256:" + "ab" * 32) == "chat-" + "ab" * 6


def test_origin_slot_lease_names_of_hf_revisions_are_dns_names() -> None:
    """Without a budget, the per-revision origin slot of an hf:<commit> revision is a valid
    Lease name; a sha256 revision keeps its 12 hex as before."""
    import re

    from preheat.control.fanout import Budget, origin_slot_names

    (name,) = origin_slot_names(Budget(), "hf:4407002f5e9aeeb2414673774a87ef9634f4cb86")
    assert re.fullmatch(r"preheat-origin-[0-9a-f]{12}", name), name
    assert origin_slot_names(Budget(), "sha256:" + "cd" * 32) == ("preheat-origin-" + "cd" * 6,)
