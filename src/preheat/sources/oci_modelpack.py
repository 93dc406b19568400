"""The CNCF ModelPack format's names, and the older CloudNativeAI names as aliases.

ModelPack (github.com/modelpack/model-spec, formerly CloudNativeAI/model-spec) named its
types ``application/vnd.cnai.model.*`` until commit 859889f ("switch to vnd.cncf.*",
2025-06-30) and its file-path annotation ``org.cnai.model.filepath`` until 9eb8979
("core: change Annotation prefix", 2025-07-07). Models pushed with tools of that time
(modctl, ramalama, olot) still carry the old names, so they are read as the same types:
``canonical`` maps a ``vnd.cnai.model`` media type to its ``vnd.cncf.model`` twin, and
``filepath`` reads either annotation (the ``org.cncf`` one first). Nothing else differs
between the two.
"""

from __future__ import annotations

import dataclasses

from preheat.artifacts.manifest import check_relpath
from preheat.errors import UnsafePath, UnsupportedMediaType
from preheat.images.manifest import Descriptor, read_descriptor
from preheat.sources.oci_layers import MODEL_TAR_LAYERS

__all__ = [
    "FILEPATH",
    "MODEL_CONFIG",
    "MODEL_MANIFEST",
    "RAW_LAYERS",
    "canonical",
    "check_filepath",
    "filepath",
    "is_model",
    "model_layer",
]

_NEW, _OLD = "application/vnd.cncf.model.", "application/vnd.cnai.model."
MODEL_MANIFEST = f"{_NEW}manifest.v1+json"
MODEL_CONFIG = f"{_NEW}config.v1+json"
FILEPATH = "org.cncf.model.filepath"
_FILEPATHS = (FILEPATH, "org.cnai.model.filepath")
_KINDS = ("weight", "weight.config", "doc", "code", "dataset")
RAW_LAYERS = frozenset(f"{_NEW}{k}.v1.raw" for k in _KINDS)


def canonical(media_type: object) -> object:
    """``media_type`` with the pre-July-2025 ``application/vnd.cnai.model.`` prefix
    replaced by ``application/vnd.cncf.model.`` (anything else as it is)."""
    if isinstance(media_type, str) and media_type.startswith(_OLD):
        return _NEW + media_type.removeprefix(_OLD)
    return media_type


def is_model(artifact_type: object, config_media_type: object) -> bool:
    """Whether a manifest with this ``artifactType`` and config media type is ModelPack."""
    return (
        canonical(artifact_type) == MODEL_MANIFEST or canonical(config_media_type) == MODEL_CONFIG
    )


def model_layer(obj: object, where: str) -> Descriptor:
    """A ModelPack layer descriptor, its media type in the ``cncf`` spelling; a type that
    is neither a raw nor a tar layer of the spec is ``UnsupportedMediaType``."""
    d = read_descriptor(obj, where)
    mt = canonical(d.media_type)
    if mt not in RAW_LAYERS and mt not in MODEL_TAR_LAYERS:
        raise UnsupportedMediaType(
            f"{where} has media type {d.media_type!r}; supported: "
            f"{', '.join(sorted(RAW_LAYERS | set(MODEL_TAR_LAYERS)))} (or the same "
            f"named {_OLD}*)"
        )
    return dataclasses.replace(d, media_type=str(mt))


def check_filepath(obj: dict[str, object], where: str) -> None:
    """A tar layer's file-path annotation, when it has one, must be safe too."""
    ann = obj.get("annotations")
    if isinstance(ann, dict) and any(k in ann for k in _FILEPATHS):
        filepath(obj, where)


def filepath(obj: dict[str, object], where: str) -> str:
    """The snapshot path a raw layer's annotation names (``org.cncf.model.filepath``, else
    ``org.cnai.model.filepath``), checked to stay inside the snapshot."""
    ann = obj.get("annotations")
    key = next((k for k in _FILEPATHS if isinstance(ann, dict) and k in ann), FILEPATH)
    path = ann.get(key) if isinstance(ann, dict) else None
    if not isinstance(path, str) or not path:
        raise UnsupportedMediaType(f"{where} has no {FILEPATH!r} annotation naming its file")
    try:
        check_relpath(path)
    except (UnsafePath, ValueError) as exc:
        raise UnsafePath(f"{where}: {key} {path!r} escapes the snapshot ({exc})") from None
    return path
