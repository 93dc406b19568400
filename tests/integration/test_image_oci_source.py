"""`oci://` model sources (CNCF ModelPack artifacts) against the real registry."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from preheat.errors import UnsafePath, UnsupportedMediaType
from preheat.sources.oci import OciSource, oci_ref
from preheat.testing.registry import Registry, registry


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with registry(tmp_path_factory.mktemp("registry")) as r:
        yield r


async def _resolve_and_read(ref: str) -> tuple[object, dict[str, bytes]]:
    src = OciSource(oci_ref(ref))
    try:
        res = await src.resolve()
        out = {}
        for f in res.manifest.files:
            chunks = [c async for c in src.fetch(res.locations[f.path], 0, f.size)]
            out[f.path] = b"".join(chunks)
        return res, out
    finally:
        await src.aclose()


def test_modelpack_files_resolve_by_layer_digest(reg: Registry) -> None:
    """Each raw layer is one file at its annotated path, its sha256 the layer digest; a
    second revision shares the unchanged file's digest (the store fetches it once)."""
    files = {"config.json": b'{"n": 1}', "weights/model-00001.safetensors": b"w" * 50_000}
    v1 = reg.push_model("models/llama:v1", files)
    v2 = reg.push_model("models/llama:v2", {**files, "config.json": b'{"n": 2}'})
    res, got = asyncio.run(_resolve_and_read(f"oci://{reg.ref('models/llama:v1')}"))
    assert res.revision == v1 and res.label == "v1"  # type: ignore[attr-defined]
    digests = {f.path: f.sha256 for f in res.manifest.files}  # type: ignore[attr-defined]
    assert digests == {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}
    assert got == files
    res2, _ = asyncio.run(_resolve_and_read(f"oci://{reg.ref('models/llama@' + v2)}"))
    digests2 = {f.path: f.sha256 for f in res2.manifest.files}  # type: ignore[attr-defined]
    w = "weights/model-00001.safetensors"
    assert res2.revision == v2  # type: ignore[attr-defined]
    assert digests2[w] == digests[w] and digests2["config.json"] != digests["config.json"]


@pytest.mark.parametrize(
    ("files", "media_type", "error", "match"),
    [
        ({"../escape.bin": b"x"}, None, UnsafePath, r"'\.\./escape\.bin' escapes"),
        ({"/abs.bin": b"x"}, None, UnsafePath, "escapes"),
        (
            {"m.bin": b"x"},
            "application/vnd.cncf.model.weight.v9.raw",
            UnsupportedMediaType,
            r"weight\.v9\.raw.*supported:.*weight\.v1\.tar\+zstd",
        ),
    ],
)
def test_bad_model_layers_are_refused(
    reg: Registry, files: dict[str, bytes], media_type: str | None, error: type, match: str
) -> None:
    """A path that escapes the snapshot, or an unknown layer type, is refused naming it."""
    tag = hashlib.sha256(repr(files).encode()).hexdigest()[:12]
    kwargs = {"media_type": media_type} if media_type else {}
    reg.push_model(f"models/bad:{tag}", files, **kwargs)
    with pytest.raises(error, match=match):
        asyncio.run(_resolve_and_read(f"oci://{reg.ref('models/bad:' + tag)}"))


def test_cache_pull_oci_fetches_only_the_changed_file_and_honours_revoke(
    reg: Registry, tmp_path: Path
) -> None:
    """`preheat cache pull oci://…` builds a snapshot of the ModelPack files; the next
    revision fetches only the file that changed; `preheat cache revoke` then refuses it."""
    import json

    from click.testing import CliRunner

    from preheat.cli import main

    weights = b"w" * 300_000
    reg.push_model("models/cli:v1", {"config.json": b'{"n": 1}', "w.safetensors": weights})
    reg.push_model("models/cli:v2", {"config.json": b'{"n": 2}', "w.safetensors": weights})
    store = str(tmp_path / "store")
    runner = CliRunner()

    def pull(tag: str) -> dict[str, object]:
        out = runner.invoke(
            main,
            ["cache", "pull", f"oci://{reg.ref('models/cli:' + tag)}", "--store", store, "--json"],
        )
        assert out.exit_code == 0, out.output
        return json.loads(out.output.strip().splitlines()[-1])

    first = pull("v1")
    snap = Path(str(first["snapshot"]))
    assert (snap / "w.safetensors").read_bytes() == weights
    assert first["bytes_fetched"] == len(weights) + len(b'{"n": 1}')
    second = pull("v2")
    assert second["bytes_fetched"] == len(b'{"n": 2}')
    assert (Path(str(second["snapshot"])) / "config.json").read_bytes() == b'{"n": 2}'
    out = runner.invoke(main, ["cache", "revoke", str(second["revision"]), "--store", store])
    assert out.exit_code == 0, out.output
    again = runner.invoke(
        main, ["cache", "pull", f"oci://{reg.ref('models/cli:v2')}", "--store", store]
    )
    assert again.exit_code == 1 and "revoked" in again.output


def test_a_model_with_the_older_cnai_names_resolves_like_a_cncf_one(reg: Registry) -> None:
    """A ModelPack model pushed with the spec's pre-July-2025 names (artifactType, layer
    types ``application/vnd.cnai.model.*``, ``org.cnai.model.filepath``) gives the same
    files as its ``cncf`` twin; a ``..`` in the old annotation is refused too."""
    from preheat.testing.registry import ModelLayer, tar_layer

    old = "application/vnd.cnai.model."
    tok = tar_layer([("tokenizer.json", b'{"t": 1}')], "gzip")
    layers = [
        ModelLayer(f"{old}weight.v1.raw", b"w" * 30_000, {"org.cnai.model.filepath": "w.bin"}),
        ModelLayer(f"{old}weight.config.v1.tar+gzip", tok),
    ]
    reg.push_model_layers("models/cnai:v1", layers, artifact_type=f"{old}manifest.v1+json")
    _, got = asyncio.run(_resolve_and_read(f"oci://{reg.ref('models/cnai:v1')}"))
    assert got == {"w.bin": b"w" * 30_000, "tokenizer.json": b'{"t": 1}'}
    bad = [ModelLayer(f"{old}weight.v1.raw", b"x", {"org.cnai.model.filepath": "../x"})]
    reg.push_model_layers("models/cnai-bad:v1", bad, artifact_type=f"{old}manifest.v1+json")
    with pytest.raises(UnsafePath, match=r"org\.cnai\.model\.filepath '\.\./x' escapes"):
        asyncio.run(_resolve_and_read(f"oci://{reg.ref('models/cnai-bad:v1')}"))
