"""The node-local registry mirror (`preheat image serve`), pulled through by skopeo."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from pathlib import Path

from preheat.images import ImageCache, parse_platform
from preheat.store import NodeStore
from preheat.testing.registry import image_mirror, registry, skopeo, tar_layer, write_layout

MiB = 1 << 20


def test_skopeo_through_the_mirror_reaches_upstream_only_for_misses(tmp_path: Path) -> None:
    """An image the cache holds is copied by skopeo through the mirror with no request at
    the upstream registry; one it lacks falls through and arrives intact."""
    held = write_layout(
        tmp_path / "held", [2 * MiB, 1000], platforms=("linux/amd64", "linux/arm64")
    )
    miss = write_layout(tmp_path / "miss", [MiB], seed=9)
    with registry(tmp_path / "reg") as reg:
        reg.push(held.path, "team/app:v1")
        reg.push(miss.path, "team/new:v1")
        store = NodeStore(tmp_path / "s")
        ImageCache(store).pull(reg.ref("team/app:v1"), platform=parse_platform("linux/amd64"))
        with image_mirror(store.root, reg.url, tmp_path / "mirror.log") as port:
            before = len(reg.requests())
            out = tmp_path / "out"
            skopeo(
                "copy",
                "--src-tls-verify=false",
                "--override-os=linux",
                "--override-arch=amd64",
                f"docker://127.0.0.1:{port}/team/app:v1",
                f"oci:{out}:v1",
            )
            assert reg.requests()[before:] == []  # the upstream saw nothing
            index = json.loads((out / "index.json").read_text())
            assert index["manifests"][0]["digest"] == held.images["linux/amd64"].manifest
            for d, _ in held.images["linux/amd64"].layers:
                assert (out / "blobs/sha256" / d.removeprefix("sha256:")).is_file()
            # a Range request on a cached blob answers 206 from the store
            layer = held.images["linux/amd64"].layers[0][0]
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v2/team/app/blobs/{layer}",
                headers={"Range": "bytes=10-19"},
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 206 and len(resp.read()) == 10
            assert reg.requests()[before:] == []
            # a miss falls through to the upstream
            skopeo(
                "copy",
                "--src-tls-verify=false",
                f"docker://127.0.0.1:{port}/team/new:v1",
                f"oci:{tmp_path / 'new'}:v1",
            )
            assert reg.requests("/v2/team/new/manifests/v1")
            got = json.loads((tmp_path / "new" / "index.json").read_text())
            assert got["manifests"][0]["digest"] == miss.digest
            # read-only
            put = urllib.request.Request(
                f"http://127.0.0.1:{port}/v2/team/app/manifests/v2", data=b"{}", method="PUT"
            )
            try:
                urllib.request.urlopen(put, timeout=10)
                raise AssertionError("PUT was accepted")
            except urllib.error.HTTPError as err:
                assert err.code == 405
                err.close()


def _manifest(port: int, ref: str) -> str:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/team/moving/manifests/{ref}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
        digest = resp.headers["Docker-Content-Digest"]
    assert digest == "sha256:" + hashlib.sha256(body).hexdigest()
    return str(digest)


def test_a_moved_tag_is_served_anew_after_the_tag_ttl(tmp_path: Path) -> None:
    """The mirror serves a cached tag as pulled until --tag-ttl passes, then re-resolves
    it upstream and serves the new image; the old one stays served by digest from the
    store, and the refresh is recorded under refs/."""
    with registry(tmp_path / "reg") as reg:
        store = NodeStore(tmp_path / "s")
        with image_mirror(store.root, reg.url, tmp_path / "mirror.log", tag_ttl=4) as port:
            old = reg.push_image("team/moving:v1", [tar_layer([("app/v", b"1")], "gzip")])
            ImageCache(store).pull(reg.ref("team/moving:v1"))
            new = reg.push_image("team/moving:v1", [tar_layer([("app/v", b"2")], "gzip")])
            before = len(reg.requests())
            assert _manifest(port, "v1") == old  # within the TTL: as pulled, no upstream
            assert reg.requests()[before:] == []
            time.sleep(max(0.0, _pulled_at(store) + 4.2 - time.time()))
            assert _manifest(port, "v1") == new  # re-resolved upstream, fetched through
            assert reg.requests("HEAD /v2/team/moving/manifests/v1")[-1:]
            seen = len(reg.requests())
            assert _manifest(port, old) == old  # the old image, by digest, from the store
            assert len(reg.requests()) == seen
            (record,) = (store.root / "refs").glob("*/mirror")
            entry = json.loads(record.read_text())
            assert entry["revision"] == new and entry["changed"] and entry["by"] == "mirror"


def _pulled_at(store: NodeStore) -> float:
    return max(i.pulled for i in ImageCache(store).images())
