"""containerd (`ctr images pull --hosts-dir`) pulling through the node mirror."""

from __future__ import annotations

from pathlib import Path

from preheat.images import ImageCache, parse_platform
from preheat.store import NodeStore
from preheat.testing.containerd import containerd
from preheat.testing.registry import image_mirror, registry, write_layout

MiB = 1 << 20


def test_ctr_pulls_a_cached_image_through_the_mirror_without_the_upstream(
    tmp_path: Path,
) -> None:
    """With the hosts.toml that `preheat k8s render` writes, containerd resolves and pulls
    a cached image from the mirror (and unpacks it) with no request at the upstream; an
    image the cache lacks still arrives, through the mirror's fall-through."""
    held = write_layout(tmp_path / "held", [2 * MiB, 1000])
    miss = write_layout(tmp_path / "miss", [MiB], seed=5)
    with registry(tmp_path / "reg") as reg:
        reg.push(held.path, "team/app:v1")
        reg.push(miss.path, "team/new:v1")
        store = NodeStore(tmp_path / "s")
        ImageCache(store).pull(reg.ref("team/app:v1"), platform=parse_platform("linux/amd64"))
        with (
            image_mirror(store.root, reg.url, tmp_path / "mirror.log") as port,
            containerd(tmp_path / "ctd") as ctd,
        ):
            hosts = ctd.hosts_dir({reg.host: f"http://127.0.0.1:{port}"})
            before = len(reg.requests())
            pull = ("images", "pull", "--hosts-dir", str(hosts), "--snapshotter", "native")
            ctd.ctr(*pull, "--platform", "linux/amd64", reg.ref("team/app:v1"))
            assert reg.requests()[before:] == []  # everything came from the mirror
            listed = ctd.ctr("images", "ls", "-q").stdout.split()
            assert reg.ref("team/app:v1") in listed
            digest = held.images["linux/amd64"].manifest
            assert digest in ctd.ctr("images", "ls").stdout
            ctd.ctr(*pull, "--platform", "linux/amd64", reg.ref("team/new:v1"))
            assert reg.requests("GET /v2/team/new/blobs/")  # the miss went upstream
            assert reg.ref("team/new:v1") in ctd.ctr("images", "ls", "-q").stdout.split()
