"""``s3://bucket/prefix`` through boto3 (``endpoint_url`` for S3-compatible servers).

Resolution lists the prefix and HEADs each object (``ChecksumMode=ENABLED``):

- revision: from object version ids when the bucket is versioned, else a digest over
  (key, ETag, LastModified, size) of every object;
- sha256: the object's ``ChecksumSHA256`` when it is a whole-object checksum, otherwise
  unknown until the fill hashes the bytes while fetching.

Ranged GETs run in threads (boto3 is blocking), one per connection. Each is pinned to
what resolution saw: ``VersionId`` in a versioned bucket (an overwrite makes a new version,
the fill keeps reading the one it resolved), and ``IfMatch`` on the ETag always; S3's 412,
or an answer with another ETag, is ``OriginChanged``.
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from preheat.artifacts.manifest import FileEntry, Manifest, revision_from_parts
from preheat.artifacts.refs import ArtifactRef, redact_url
from preheat.errors import ObjectNotFound, OriginChanged, OriginUnavailable, TruncatedBody
from preheat.sources.base import Location, Resolution

_READ = 4 << 20


def _translate(exc: Exception, what: str, etag: str | None = None) -> Exception:
    """A boto3/botocore error as preheat's; ``etag`` is the one a ranged GET was pinned to."""
    import botocore.exceptions as bce

    said = redact_url(str(exc))  # botocore names the endpoint URL in some messages
    if isinstance(exc, bce.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("PreconditionFailed", "412") or status == 412:
            return OriginChanged(
                f"{what} changed at the origin since it was resolved (S3 answered 412 "
                f"PreconditionFailed for ETag {etag}); nothing of it was published; pull "
                "again to fetch the new revision"
            )
        if code in ("NoSuchKey", "NoSuchBucket", "404", "NoSuchVersion") or status == 404:
            return ObjectNotFound(f"{what}: not found at the origin ({code or status})")
        if code in ("AccessDenied", "403") or status == 403:
            return ObjectNotFound(f"{what}: access denied ({code}); check credentials")
        return OriginUnavailable(f"{what}: S3 error {code or status}: {said}")
    if isinstance(exc, bce.ResponseStreamingError | bce.IncompleteReadError):
        return TruncatedBody(f"{what}: body ended early: {said}")
    if isinstance(exc, bce.BotoCoreError | OSError):
        return OriginUnavailable(f"{what}: cannot reach S3: {said}")
    return exc


class S3Source:
    def __init__(
        self, ref: ArtifactRef, *, endpoint_url: str | None = None, connections: int = 8
    ) -> None:
        import boto3
        from botocore.config import Config

        self.ref = ref
        self._bucket = ref.bucket
        prefix = ref.location
        self._prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self._endpoint = endpoint_url
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            config=Config(
                max_pool_connections=connections + 4,
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=10,
                read_timeout=60,
            ),
        )
        self._pool = ThreadPoolExecutor(max_workers=connections + 4, thread_name_prefix="s3")

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def resolve(self) -> Resolution:
        where = f"s3://{self._bucket}/{self._prefix}"
        try:
            keys = await self._run(self._list)
        except Exception as exc:
            raise _translate(exc, where) from exc
        if not keys:
            raise ObjectNotFound(f"{where}: no objects under this prefix; check bucket and prefix")
        heads = await asyncio.gather(*(self._run(self._head, k) for k, _ in keys))
        entries, locations = [], {}
        versioned = all(h.get("VersionId") not in (None, "null") for h in heads)
        parts = []
        for (key, size), head in zip(keys, heads, strict=True):
            rel = key[len(self._prefix) :]
            checksum = head.get("ChecksumSHA256")
            sha = None
            if checksum and "-" not in checksum and head.get("ChecksumType") != "COMPOSITE":
                sha = base64.b64decode(checksum).hex()
            version = head.get("VersionId") if versioned else None
            etag = str(head.get("ETag", "")).strip('"')
            # unversioned: ETag + size + LastModified (a multipart ETag is not a content hash)
            modified = "" if versioned else str(head.get("LastModified", ""))
            ident = version or f"{etag}\0{modified}"
            fp = f"s3\0{self._endpoint}\0{self._bucket}\0{key}\0{ident}\0{size}"
            entries.append(FileEntry(rel, int(size), sha))
            locations[rel] = Location(key, fp, version=version, etag=head.get("ETag") or None)
            parts.append((key, ident, str(size)))
        revision = revision_from_parts("s3-version" if versioned else "s3-etag", parts)
        return Resolution(self.ref, revision, Manifest(tuple(entries)), locations)

    def _list(self) -> list[tuple[str, int]]:
        out = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=self._prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/"):
                    continue  # "directory" placeholder objects
                out.append((key, int(obj["Size"])))
        return out

    def _head(self, key: str) -> dict[str, Any]:
        try:
            return dict(
                self._client.head_object(Bucket=self._bucket, Key=key, ChecksumMode="ENABLED")
            )
        except Exception as exc:
            raise _translate(exc, f"s3://{self._bucket}/{key}") from exc

    async def fetch(self, location: Location, start: int, end: int) -> AsyncGenerator[bytes, None]:
        what = f"s3://{self._bucket}/{location.url}"
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": location.url,
            "Range": f"bytes={start}-{end - 1}",
        }
        if location.version:
            kwargs["VersionId"] = location.version
        if location.etag:
            kwargs["IfMatch"] = location.etag
        pos = start
        try:
            resp = await self._run(lambda: self._client.get_object(**kwargs))
        except Exception as exc:
            raise _translate(exc, what, location.etag) from exc
        body = resp["Body"]
        etag = resp.get("ETag")
        if location.etag and etag and etag.strip('"') != location.etag.strip('"'):
            body.close()  # an S3-compatible server that ignores IfMatch
            raise OriginChanged(
                f"{what} changed at the origin since it was resolved (ETag {location.etag} "
                f"is now {etag}); nothing of it was published; pull again"
            )
        try:
            while pos < end:
                try:
                    data = await self._run(body.read, min(_READ, end - pos))
                except Exception as exc:
                    raise _translate(exc, what) from exc
                if not data:
                    break
                pos += len(data)
                yield data
        finally:
            body.close()
        if pos < end:
            raise TruncatedBody(f"{what}: body ended at byte {pos}, expected {end}")
