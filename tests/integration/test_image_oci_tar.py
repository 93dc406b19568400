"""`oci://` tar layers (ModelPack `.tar`, `+gzip`, `+zstd`) and KServe modelcars against
the real registry: unpacked into snapshots, unchanged layers not fetched again, every
malicious entry refused with nothing published."""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.errors import ImageDigestMismatch, NoModelFiles, Revoked, UnsafePath
from preheat.store.store import NodeStore
from preheat.testing.registry import (
    ModelLayer,
    Registry,
    TarMember,
    registry,
    tar_info,
    tar_layer,
    write_layout,
)

WEIGHT = "application/vnd.cncf.model.weight.v1.tar"
CONFIG = "application/vnd.cncf.model.weight.config.v1.tar"
SUFFIX = {"": "", "gzip": "+gzip", "zstd": "+zstd"}


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with registry(tmp_path_factory.mktemp("registry")) as r:
        yield r


def _files(snapshot: Path) -> dict[str, bytes]:
    return {
        p.relative_to(snapshot).as_posix(): p.read_bytes()
        for p in sorted(snapshot.rglob("*"))
        if p.is_file()
    }


def _tag(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


@pytest.mark.parametrize("compression", ["", "gzip", "zstd"])
def test_modelpack_tar_layers_unpack_into_the_snapshot(
    reg: Registry, tmp_path: Path, compression: str
) -> None:
    """Weight and weight-config tar layers (plain, gzip, zstd) become the snapshot's files
    beside a raw layer; a hard link inside a layer is a second path to the same bytes."""
    a, b = b"a" * 70_000, b"b" * 30_000
    weights = tar_layer(
        [
            tar_info("weights", tarfile.DIRTYPE),
            ("weights/a.safetensors", a),
            ("./weights/b.safetensors", b),
            tar_info("weights/alias.safetensors", tarfile.LNKTYPE, "weights/a.safetensors"),
        ],
        compression,
    )
    config = tar_layer([("config.json", b'{"n": 1}')], compression)
    layers = [
        ModelLayer(WEIGHT + SUFFIX[compression], weights, {"org.cncf.model.filepath": "weights"}),
        ModelLayer(CONFIG + SUFFIX[compression], config),
        ModelLayer(
            "application/vnd.cncf.model.doc.v1.raw",
            b"# readme",
            {"org.cncf.model.filepath": "README.md"},
        ),
    ]
    name = f"models/tar:{compression or 'plain'}"
    digest = reg.push_model_layers(name, layers)
    store = NodeStore(tmp_path / "store")
    got = store.pull(f"oci://{reg.ref(name)}")
    assert got.revision == digest
    assert _files(got.snapshot) == {
        "README.md": b"# readme",
        "config.json": b'{"n": 1}',
        "weights/a.safetensors": a,
        "weights/alias.safetensors": a,
        "weights/b.safetensors": b,
    }
    snap = got.snapshot
    assert (snap / "weights/a.safetensors").stat().st_ino == (
        snap / "weights/alias.safetensors"
    ).stat().st_ino
    assert not list((tmp_path / "store" / "tmp").glob("oci-*"))  # staging removed


def test_an_unchanged_tar_layer_is_not_fetched_again(reg: Registry, tmp_path: Path) -> None:
    """A second revision that changes only the config layer fetches only that layer: the
    weights layer's listing is kept by digest and its blobs are in the store."""
    weights = tar_layer([("w.safetensors", b"w" * 200_000)], "gzip")
    v1 = [
        ModelLayer(WEIGHT + "+gzip", weights),
        ModelLayer(CONFIG, tar_layer([("config.json", b'{"n": 1}')])),
    ]
    v2 = [v1[0], ModelLayer(CONFIG, tar_layer([("config.json", b'{"n": 2}')]))]
    reg.push_model_layers("models/dedup:v1", v1)
    reg.push_model_layers("models/dedup:v2", v2)
    w_digest = "sha256:" + hashlib.sha256(weights).hexdigest()
    store = NodeStore(tmp_path / "store")
    first = store.pull(f"oci://{reg.ref('models/dedup:v1')}")
    gets = len(reg.requests(f"GET /v2/models/dedup/blobs/{w_digest}"))
    assert gets >= 1 and first.bytes_fetched == 200_000 + len(b'{"n": 1}')
    second = store.pull(f"oci://{reg.ref('models/dedup:v2')}")
    assert len(reg.requests(f"GET /v2/models/dedup/blobs/{w_digest}")) == gets
    assert second.bytes_fetched == len(b'{"n": 2}')
    assert _files(second.snapshot) == {"w.safetensors": b"w" * 200_000, "config.json": b'{"n": 2}'}


def _evil(case: str) -> list[ModelLayer]:
    t = tar_info
    members: dict[str, list[TarMember]] = {
        "dotdot": [("../escape.bin", b"x")],
        "absolute": [("/etc/cron.d/evil", b"x")],
        "symlink": [t("weights.bin", tarfile.SYMTYPE, "/etc/passwd")],
        "symlink-inside": [("a.bin", b"x"), t("b.bin", tarfile.SYMTYPE, "a.bin")],
        "hardlink-outside": [t("w.bin", tarfile.LNKTYPE, "../../etc/shadow")],
        "hardlink-missing": [t("w.bin", tarfile.LNKTYPE, "nothing.bin")],
        "device": [t("null", tarfile.CHRTYPE)],
        "fifo": [t("pipe", tarfile.FIFOTYPE)],
        "duplicate": [("w.bin", b"one"), ("w.bin", b"two")],
        "file-and-dir": [("w", b"file"), ("w/x.bin", b"under a file")],
    }
    if case == "across-layers":
        return [
            ModelLayer(WEIGHT, tar_layer([("w.bin", b"one")])),
            ModelLayer(
                "application/vnd.cncf.model.weight.v1.raw",
                b"two",
                {"org.cncf.model.filepath": "w.bin"},
            ),
        ]
    if case == "bad-annotation":
        return [
            ModelLayer(
                WEIGHT, tar_layer([("w.bin", b"one")]), {"org.cncf.model.filepath": "../w.bin"}
            )
        ]
    return [ModelLayer(WEIGHT, tar_layer([("ok.bin", b"fine"), *members[case]]))]


EVIL = [
    ("dotdot", r"'\.\./escape\.bin' escapes"),
    ("absolute", "absolute path"),
    ("symlink", "symbolic link"),
    ("symlink-inside", "symbolic link"),
    ("hardlink-outside", "escapes"),
    ("hardlink-missing", "not a regular file"),
    ("device", "device file"),
    ("fifo", "FIFO"),
    ("duplicate", "appears twice"),
    ("file-and-dir", "which is a file"),
    ("across-layers", "is also in"),
    ("bad-annotation", "escapes the snapshot"),
]


@pytest.mark.parametrize(("case", "match"), EVIL, ids=[c for c, _ in EVIL])
def test_malicious_tar_entries_are_refused(
    reg: Registry, tmp_path: Path, case: str, match: str
) -> None:
    """Each unsafe entry (escape, absolute, links, devices, duplicates) is refused naming
    it, and the store publishes nothing."""
    name = f"models/evil:{case}"
    reg.push_model_layers(name, _evil(case))
    store = NodeStore(tmp_path / "store")
    with pytest.raises(UnsafePath, match=match):
        store.pull(f"oci://{reg.ref(name)}")
    assert store.snapshots() == [] and not list((tmp_path / "store" / "snapshots").iterdir())
    assert not list((tmp_path / "store" / "tmp").glob("oci-*"))


def test_the_layer_digest_is_checked_before_unpacking(reg: Registry, tmp_path: Path) -> None:
    """A layer whose bytes at the registry were swapped for a malicious tar of the same
    size is refused as a digest mismatch: it is never unpacked, nothing is published."""
    good = tar_layer([("w.bin", bytes(range(256)) * 100)])
    reg.push_model_layers("models/swapped:v1", [ModelLayer(WEIGHT, good)])
    evil = tar_layer([("../escape.bin", b"x")])
    blob = reg.blob_file("sha256:" + hashlib.sha256(good).hexdigest())
    blob.write_bytes(evil + b"\0" * (len(good) - len(evil)))
    store = NodeStore(tmp_path / "store", retries=0)
    with pytest.raises(ImageDigestMismatch, match="refused before unpacking"):
        store.pull(f"oci://{reg.ref('models/swapped:v1')}")
    assert store.snapshots() == []
    assert (
        not (tmp_path / "escape.bin").exists() and not (tmp_path / "store" / "escape.bin").exists()
    )


# --- KServe modelcars ------------------------------------------------------------------


def test_a_modelcar_applies_its_layers_with_whiteouts(reg: Registry, tmp_path: Path) -> None:
    """An ordinary image's files under /models become the snapshot after its layers are
    applied in order: `.wh.` whiteouts and opaque directories hide lower files, later
    files replace earlier ones, and what lies outside /models (links, devices) is ignored."""
    t = tar_info
    base = tar_layer(
        [
            t("bin", tarfile.DIRTYPE),
            ("bin/busybox", b"\x7fELF"),
            t("bin/sh", tarfile.SYMTYPE, "busybox"),
            t("dev/null", tarfile.CHRTYPE),
            t("models", tarfile.DIRTYPE),
            ("models/config.json", b'{"v": 1}'),
            ("models/old.bin", b"old"),
            ("models/sub/x.bin", b"x"),
        ],
        "gzip",
    )
    upper = tar_layer(
        [
            ("models/.wh.old.bin", b""),
            ("models/sub/.wh..wh..opq", b""),
            ("models/sub/y.bin", b"y"),
            ("models/config.json", b'{"v": 2}'),
            t("models/config-link.json", tarfile.LNKTYPE, "models/config.json"),
        ],
        "",
    )
    top = tar_layer([("models/extra.bin", b"e" * 10_000)], "zstd")
    digest = reg.push_image("kserve/car:v1", [base, upper, top])
    got = NodeStore(tmp_path / "store").pull(f"oci://{reg.ref('kserve/car:v1')}")
    assert got.revision == digest
    assert _files(got.snapshot) == {
        "config.json": b'{"v": 2}',
        "config-link.json": b'{"v": 2}',
        "sub/y.bin": b"y",
        "extra.bin": b"e" * 10_000,
    }


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([tar_info("models/w.bin", tarfile.SYMTYPE, "/etc/passwd")], "symbolic link"),
        ([tar_info("models", tarfile.SYMTYPE, "/etc")], "not a directory"),
        ([tar_info("models/w.bin", tarfile.LNKTYPE, "etc/passwd")], "outside the snapshot"),
        ([("models/../../escape", b"x")], "escapes"),
    ],
    ids=["symlink", "root-is-a-link", "hardlink-outside", "dotdot"],
)
def test_unsafe_modelcar_entries_are_refused(
    reg: Registry, tmp_path: Path, members: list[TarMember], match: str
) -> None:
    """A modelcar whose /models holds a link out, is itself a link, or escapes is refused."""
    name = f"kserve/evil:{_tag(members)}"
    reg.push_image(name, [tar_layer([("etc/passwd", b"root:x"), *members])])
    store = NodeStore(tmp_path / "store")
    with pytest.raises(UnsafePath, match=match):
        store.pull(f"oci://{reg.ref(name)}")
    assert store.snapshots() == []


def test_an_image_with_nothing_under_models_is_refused(reg: Registry, tmp_path: Path) -> None:
    """An ordinary image without /models is neither a modelcar nor a ModelPack model: the
    error says what it is and what to use."""
    layout = write_layout(tmp_path / "img", [1000])
    reg.push(layout.path, "team/app:v1")
    with pytest.raises(NoModelFiles, match=r"no files under /models.*image pull"):
        NodeStore(tmp_path / "store").pull(f"oci://{reg.ref('team/app:v1')}")


def test_a_revoked_tar_layer_is_refused_before_it_is_fetched(reg: Registry, tmp_path: Path) -> None:
    """Revoking a tar layer's digest (a withdrawn base layer) refuses every model that
    has it with "revoked", before the layer is downloaded."""
    from preheat.store.revoke import revoke

    layer = tar_layer([("w.bin", b"bad" * 1000)], "gzip")
    reg.push_model_layers("models/withdrawn:v1", [ModelLayer(WEIGHT + "+gzip", layer)])
    digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    store = NodeStore(tmp_path / "store")
    revoke(store._db, store._space, digest, "CVE-0000")
    with pytest.raises(Revoked, match=r"revoked: sha256:[0-9a-f]{64} .*CVE-0000"):
        store.pull(f"oci://{reg.ref('models/withdrawn:v1')}")
    assert reg.requests(f"/blobs/{digest}") == [] and store.snapshots() == []


def test_staging_left_by_a_killed_pull_is_swept(reg: Registry, tmp_path: Path) -> None:
    """A staging dir whose owner is gone (its lock free) is removed by the next tar pull;
    one whose lock is held (a live pull) stays."""
    import fcntl
    import os

    reg.push_model_layers("models/sweep:v1", [ModelLayer(WEIGHT, tar_layer([("w.bin", b"w")]))])
    store = NodeStore(tmp_path / "store")
    dead, live = store.root / "tmp" / "oci-dead", store.root / "tmp" / "oci-live"
    for d in (dead, live):
        d.mkdir()
        (d / ".lock").touch()
        (d / ("0" * 64)).write_bytes(b"staged")
    fd = os.open(live / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        store.pull(f"oci://{reg.ref('models/sweep:v1')}")
        assert not dead.exists() and (live / ("0" * 64)).is_file()
    finally:
        os.close(fd)
