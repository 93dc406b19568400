"""ModelPack's media types and file-path annotation, with the older ``cnai`` names."""

from __future__ import annotations

import pytest

from preheat.errors import UnsafePath, UnsupportedMediaType
from preheat.sources.oci_modelpack import canonical, filepath, is_model, model_layer

OLD, NEW = "application/vnd.cnai.model.", "application/vnd.cncf.model."
DIGEST = "sha256:" + "a" * 64


def test_the_cnai_prefix_is_read_as_the_cncf_one() -> None:
    """Every older ``vnd.cnai.model`` type maps to its ``vnd.cncf.model`` twin; other
    types (and non-strings) pass through unchanged."""
    assert canonical(f"{OLD}weight.v1.tar+zstd") == f"{NEW}weight.v1.tar+zstd"
    assert canonical(f"{OLD}config.v1+json") == f"{NEW}config.v1+json"
    assert canonical("application/vnd.oci.image.layer.v1.tar") == (
        "application/vnd.oci.image.layer.v1.tar"
    )
    assert canonical(None) is None


def test_a_manifest_is_a_model_by_either_artifact_type_or_config() -> None:
    """The old and new artifactType and config media type each mark a ModelPack model."""
    assert is_model(f"{OLD}manifest.v1+json", None)
    assert is_model(None, f"{OLD}config.v1+json")
    assert is_model(f"{NEW}manifest.v1+json", "application/vnd.oci.image.config.v1+json")
    assert not is_model(None, "application/vnd.oci.image.config.v1+json")


def test_layers_come_out_in_the_cncf_spelling_and_unknown_ones_are_named() -> None:
    """An old-name layer descriptor reads as the new type; an unknown one is refused
    naming it and the supported types."""
    d = model_layer({"mediaType": f"{OLD}doc.v1.raw", "digest": DIGEST, "size": 3}, "l[0]")
    assert d.media_type == f"{NEW}doc.v1.raw" and d.size == 3
    with pytest.raises(UnsupportedMediaType, match=r"'application/vnd\.cnai\.model\.x\.v1'.*or"):
        model_layer({"mediaType": f"{OLD}x.v1", "digest": DIGEST, "size": 1}, "l[1]")


def test_either_filepath_annotation_names_the_file_the_cncf_one_first() -> None:
    """``org.cncf.model.filepath`` wins over ``org.cnai.model.filepath``; either is checked
    to stay inside the snapshot; a layer with neither is refused naming the annotation."""
    both = {"org.cncf.model.filepath": "a.bin", "org.cnai.model.filepath": "b.bin"}
    assert filepath({"annotations": both}, "l") == "a.bin"
    assert filepath({"annotations": {"org.cnai.model.filepath": "d/b.bin"}}, "l") == "d/b.bin"
    with pytest.raises(UnsafePath, match=r"org\.cnai\.model\.filepath '/etc/x' escapes"):
        filepath({"annotations": {"org.cnai.model.filepath": "/etc/x"}}, "l")
    with pytest.raises(UnsupportedMediaType, match=r"org\.cncf\.model\.filepath"):
        filepath({"annotations": {}}, "l")
