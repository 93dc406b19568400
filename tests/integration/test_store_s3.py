"""S3 origin (moto's server on 127.0.0.1): checksums, versions, ETag revisions, errors."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preheat.errors import ObjectNotFound, OriginUnavailable
from preheat.store import NodeStore
from preheat.testing.origins import S3Origin, free_port, s3_origin

KiB = 1 << 10


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Origin]:
    with s3_origin() as origin:
        yield origin


def _bucket(s3: S3Origin, name: str, *, versioned: bool = False) -> Any:
    c = s3.client()
    c.create_bucket(Bucket=name)
    if versioned:
        c.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return c


def _payload(i: int, size: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (size // 32)


def test_s3_pull_with_and_without_checksums(tmp_path: Path, s3: S3Origin) -> None:
    """Objects with SHA-256 checksums use them; the rest are hashed while fetching."""
    c = _bucket(s3, "plain")
    files = {"model/config.json": b'{"a": 1}', "model/w/shard-1.bin": _payload(1, 600 * KiB)}
    c.put_object(Bucket="plain", Key="model/config.json", Body=files["model/config.json"])
    c.put_object(
        Bucket="plain",
        Key="model/w/shard-1.bin",
        Body=files["model/w/shard-1.bin"],
        ChecksumAlgorithm="SHA256",
    )
    c.put_object(Bucket="plain", Key="other/ignored.bin", Body=b"x")
    store = NodeStore(tmp_path / "store", retries=1, backoff=0.01)
    revision, manifest = store.resolve("s3://plain/model", endpoint_url=s3.endpoint_url)
    declared = {f.path: f.sha256 for f in manifest.files}
    assert declared["w/shard-1.bin"] == hashlib.sha256(files["model/w/shard-1.bin"]).hexdigest()
    assert declared["config.json"] is None  # no SHA-256 checksum: hashed while fetching
    r = store.pull("s3://plain/model", endpoint_url=s3.endpoint_url, chunk=128 * KiB)
    assert r.revision == revision
    assert r.revision.startswith("s3-etag:")
    for key, body in files.items():
        rel = key.removeprefix("model/")
        assert (r.snapshot / rel).read_bytes() == body
    entries = {f.path: f.sha256 for f in store.manifest(r.manifest_digest).files}
    assert entries == {
        k.removeprefix("model/"): hashlib.sha256(v).hexdigest() for k, v in files.items()
    }
    again = store.pull("s3://plain/model", endpoint_url=s3.endpoint_url)
    assert again.bytes_fetched == 0 and again.revision == r.revision
    # the unchecksummed object changes: a new revision that moves only that object
    c.put_object(Bucket="plain", Key="model/config.json", Body=b'{"a": 2}')
    v2 = store.pull("s3://plain/model", endpoint_url=s3.endpoint_url)
    assert v2.revision != r.revision and v2.bytes_fetched == len(b'{"a": 2}')


def test_s3_versioned_bucket_revision_from_version_ids(tmp_path: Path, s3: S3Origin) -> None:
    """In a versioned bucket the revision comes from version ids and pins those versions."""
    c = _bucket(s3, "versioned", versioned=True)
    c.put_object(Bucket="versioned", Key="m/a.bin", Body=_payload(2, 64 * KiB))
    store = NodeStore(tmp_path / "store", retries=1, backoff=0.01)
    r1 = store.pull("s3://versioned/m", endpoint_url=s3.endpoint_url)
    assert r1.revision.startswith("s3-version:")
    c.put_object(Bucket="versioned", Key="m/a.bin", Body=_payload(3, 64 * KiB))
    r2 = store.pull("s3://versioned/m", endpoint_url=s3.endpoint_url)
    assert r2.revision != r1.revision
    assert (r2.snapshot / "a.bin").read_bytes() == _payload(3, 64 * KiB)
    assert (r1.snapshot / "a.bin").read_bytes() == _payload(2, 64 * KiB)


def test_s3_missing_prefix_and_unreachable(tmp_path: Path, s3: S3Origin) -> None:
    """An empty prefix is ObjectNotFound; a dead endpoint is OriginUnavailable."""
    _bucket(s3, "empty")
    store = NodeStore(tmp_path / "store", retries=1, backoff=0.01)
    with pytest.raises(ObjectNotFound, match="no objects"):
        store.pull("s3://empty/nothing", endpoint_url=s3.endpoint_url)
    with pytest.raises(ObjectNotFound):
        store.pull("s3://no-such-bucket/x", endpoint_url=s3.endpoint_url)
    with pytest.raises(OriginUnavailable):
        store.pull("s3://empty/x", endpoint_url=f"http://127.0.0.1:{free_port()}")
    assert store.snapshots() == []
