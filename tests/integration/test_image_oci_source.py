"""`oci://` model sources (CNCF ModelPack artifacts) against the real registry."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from preheat.errors import UnsafePath, UnsupportedMediaType
from preheat.sources.oci import OciSource, oci_ref
from preheat.testing.registry import registry, write_layout


async def _read(src: OciSource) -> dict[str, bytes]:
    res = await src.resolve()
    out = {}
    for f in res.manifest.files:
        chunks = [c async for c in src.fetch(res.locations[f.path], 0, f.size)]
        out[f.path] = b"".join(chunks)
    return out


def test_modelpack_files_resolve_by_layer_digest(tmp_path: Path) -> None:
    """Each raw layer is one file at its annotated path, its sha256 the layer digest; a
    second revision shares the unchanged file's digest (the store fetches it once)."""
    files = {"config.json": b'{"n": 1}', "weights/model-00001.safetensors": b"w" * 50_000}
    with registry(tmp_path / "reg") as reg:
        v1 = reg.push_model("models/llama:v1", files)
        v2 = reg.push_model("models/llama:v2", {**files, "config.json": b'{"n": 2}'})

        async def go() -> None:
            src = OciSource(oci_ref(f"oci://{reg.ref('models/llama:v1')}"))
            try:
                res = await src.resolve()
                assert res.revision == v1 and res.label == "v1"
                assert {f.path: f.sha256 for f in res.manifest.files} == {
                    p: hashlib.sha256(b).hexdigest() for p, b in files.items()
                }
                assert await _read(src) == files
            finally:
                await src.aclose()
            src2 = OciSource(oci_ref(f"oci://{reg.ref('models/llama@' + v2)}"))
            try:
                res2 = await src2.resolve()
            finally:
                await src2.aclose()
            w = "weights/model-00001.safetensors"
            assert res2.revision == v2
            digests = {f.path: f.sha256 for f in res.manifest.files}
            digests2 = {f.path: f.sha256 for f in res2.manifest.files}
            assert digests2[w] == digests[w] and digests2["config.json"] != digests["config.json"]
            assert res2.locations[w].fingerprint == res.locations[w].fingerprint

        asyncio.run(go())


@pytest.mark.parametrize(
    ("files", "media_type", "error", "match"),
    [
        ({"../escape.bin": b"x"}, None, UnsafePath, r"'\.\./escape\.bin' escapes"),
        ({"/abs.bin": b"x"}, None, UnsafePath, "escapes"),
        (
            {"m.tar": b"x"},
            "application/vnd.cncf.model.weight.v1.tar",
            UnsupportedMediaType,
            r"weight\.v1\.tar.*not unpacked",
        ),
    ],
)
def test_bad_model_layers_are_refused(
    tmp_path: Path, files: dict[str, bytes], media_type: str | None, error: type, match: str
) -> None:
    """A path that escapes the snapshot, or a tar layer, is refused naming it."""
    with registry(tmp_path / "reg") as reg:
        kwargs = {"media_type": media_type} if media_type else {}
        reg.push_model("models/bad:v1", files, **kwargs)

        async def go() -> None:
            src = OciSource(oci_ref(f"oci://{reg.ref('models/bad:v1')}"))
            try:
                with pytest.raises(error, match=match):
                    await src.resolve()
            finally:
                await src.aclose()

        asyncio.run(go())


def test_a_container_image_is_not_a_model(tmp_path: Path) -> None:
    """An ordinary image at an oci:// ref is refused with what it is and what to use."""
    layout = write_layout(tmp_path / "img", [1000])
    with registry(tmp_path / "reg") as reg:
        reg.push(layout.path, "team/app:v1")

        async def go() -> None:
            src = OciSource(oci_ref(f"oci://{reg.ref('team/app:v1')}"))
            try:
                with pytest.raises(
                    UnsupportedMediaType, match=r"not a ModelPack model.*image pull"
                ):
                    await src.resolve()
            finally:
                await src.aclose()

        asyncio.run(go())
