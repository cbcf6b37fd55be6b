"""Saving ONNX models of any size: one file, or weights beside it when protobuf cannot hold them."""

from __future__ import annotations

from pathlib import Path

import onnx
from omskills.records.deploy import external_data_path

# Protobuf cannot serialise a message over 2 GiB; keep a margin for the graph itself.
EXTERNAL_DATA_THRESHOLD_BYTES = 2**31 - 2**26
# Tensors smaller than this stay inside the .onnx even then (shape constants and the like).
EXTERNAL_TENSOR_MIN_BYTES = 1024


def data_path(path: Path) -> Path:
    """Where a model's external weights go (see records.deploy.external_data_path)."""
    return external_data_path(path)


def save_onnx(model: onnx.ModelProto, path: Path, size: int | None = None) -> bool:
    """Save as one .onnx, or .onnx + one .onnx.data when the model (`size` bytes, default its
    protobuf size) is too big for protobuf. Returns whether weights went to the .data file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    external = data_path(path)
    # onnx appends to an existing external-data file: start clean on a rerun.
    path.unlink(missing_ok=True)
    external.unlink(missing_ok=True)
    if (size if size is not None else model.ByteSize()) >= EXTERNAL_DATA_THRESHOLD_BYTES:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=external.name, size_threshold=EXTERNAL_TENSOR_MIN_BYTES)
    return _saved(model, path, external)


def _saved(model: onnx.ModelProto, path: Path, external: Path) -> bool:
    if not path.exists():
        onnx.save_model(model, str(path))
    return external.is_file()  # no .data when every tensor is under the per-tensor threshold


def released(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` parsed anew from its own bytes. Protobuf keeps a parsed message's bytes in one
    arena that lives as long as any part of the message does: once its weights are moved out or
    cleared, the old message still holds their bytes (gigabytes for a full-scale backbone)."""
    return onnx.ModelProto.FromString(model.SerializeToString())
