"""Saving ONNX models of any size: one file, or weights beside it when protobuf cannot hold them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx
from omskills.records.deploy import external_data_path
from onnx import TensorProto
from onnx.external_data_helper import ExternalDataInfo

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
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=external.name,
            size_threshold=EXTERNAL_TENSOR_MIN_BYTES,
        )
    return _saved(model, path, external)


def save_onnx_streamed(model: onnx.ModelProto, path: Path, weights_dir: Path, size: int) -> bool:
    """`save_onnx` for a model whose weights are still in external files under `weights_dir` (an
    exporter's output): they are copied to `path` one tensor at a time, instead of being loaded
    into the model and serialised beside it (for a 2 GB backbone that is 4 GB more memory next
    to the PyTorch model being exported). `size`: the model's bytes with its weights."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    external = data_path(path)
    path.unlink(missing_ok=True)
    external.unlink(missing_ok=True)
    try:
        if size >= EXTERNAL_DATA_THRESHOLD_BYTES:
            _copy_weights(model, weights_dir, external)
            onnx.save_model(model, str(path))
        else:
            _write_inline(model, path, weights_dir)
    except Exception as exc:  # a half-written model must not stand at `path`
        path.unlink(missing_ok=True)
        external.unlink(missing_ok=True)
        raise ValueError(f"cannot save {path.name} with its weights from {weights_dir}: {exc}") from exc
    return external.is_file()


# Protobuf tags (field number << 3 | length-delimited) of ModelProto.graph and GraphProto.initializer.
_GRAPH_TAG = bytes([7 << 3 | 2])
_INITIALIZER_TAG = bytes([5 << 3 | 2])
_RAW_DATA_TAG_BYTES = 1  # TensorProto.raw_data is field 9: a one-byte tag


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _external_bytes(tensor: TensorProto, weights_dir: Path) -> bytes:
    info = ExternalDataInfo(tensor)
    source = Path(weights_dir) / info.location
    with open(source, "rb") as handle:
        handle.seek(info.offset or 0)
        value = handle.read(info.length) if info.length else handle.read()
    if info.length and len(value) != info.length:
        raise ValueError(f"{source} holds {len(value)} of the {info.length} bytes of {tensor.name!r}")
    return value


def _external_length(tensor: TensorProto, weights_dir: Path) -> int:
    info = ExternalDataInfo(tensor)
    return info.length if info.length else (Path(weights_dir) / info.location).stat().st_size - (info.offset or 0)


def _inline_entry(tensor: TensorProto, weights_dir: Path) -> bytes:
    """One `GraphProto.initializer` field, the tensor's bytes inline."""
    if tensor.data_location == TensorProto.EXTERNAL:
        inline = TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = TensorProto.DEFAULT
        inline.raw_data = _external_bytes(tensor, weights_dir)
        tensor = inline
    body = tensor.SerializeToString()
    return _INITIALIZER_TAG + _varint(len(body)) + body


def _entry_size(tensor: TensorProto, weights_dir: Path) -> int:
    """len(_inline_entry(tensor)) without reading the tensor's bytes."""
    if tensor.data_location != TensorProto.EXTERNAL:
        body = tensor.ByteSize()
    else:
        meta = TensorProto()
        meta.CopyFrom(tensor)
        del meta.external_data[:]
        meta.data_location = TensorProto.DEFAULT
        length = _external_length(tensor, weights_dir)
        body = meta.ByteSize() + _RAW_DATA_TAG_BYTES + len(_varint(length)) + length
    return len(_INITIALIZER_TAG) + len(_varint(body)) + body


def _write_inline(model: onnx.ModelProto, path: Path, weights_dir: Path) -> None:
    """`model` as one .onnx, its initializers written one at a time. A message's fields may come
    in any order on the wire, so the graph is its other fields followed by the initializers."""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)  # small: the weights are references to files
    initializers = [TensorProto.FromString(t.SerializeToString()) for t in skeleton.graph.initializer]
    del skeleton.graph.initializer[:]
    onnx.external_data_helper.load_external_data_for_model(skeleton, str(weights_dir))  # constants in attributes
    graph = skeleton.graph.SerializeToString()
    skeleton.ClearField("graph")
    graph_size = len(graph) + sum(_entry_size(t, weights_dir) for t in initializers)
    with open(path, "wb") as handle:
        handle.write(skeleton.SerializeToString())
        handle.write(_GRAPH_TAG + _varint(graph_size) + graph)
        written = len(graph)
        for tensor in initializers:
            entry = _inline_entry(tensor, weights_dir)
            handle.write(entry)
            written += len(entry)
    if written != graph_size:  # the length written before the graph must be its length
        raise ValueError(f"{path.name}: wrote a graph of {written} bytes, announced {graph_size}")


def _copy_weights(model: onnx.ModelProto, weights_dir: Path, data: Path) -> None:
    """Every external tensor's bytes copied from `weights_dir` to `data`, in place: the model's
    references then point there (a location relative to the model's folder)."""
    with open(data, "wb") as handle:
        for tensor in all_tensors(model.graph):
            if tensor.data_location != TensorProto.EXTERNAL:
                continue
            value = _external_bytes(tensor, weights_dir)
            offset = handle.tell()
            handle.write(value)
            del tensor.external_data[:]
            for key, entry in (("location", data.name), ("offset", str(offset)), ("length", str(len(value)))):
                tensor.external_data.add(key=key, value=entry)
    if not data.stat().st_size:
        data.unlink()


def all_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """The graph's initializers and the tensors in its nodes' attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from all_tensors(subgraph)


def _saved(model: onnx.ModelProto, path: Path, external: Path) -> bool:
    if not path.exists():
        onnx.save_model(model, str(path))
    return external.is_file()  # no .data when every tensor is under the per-tensor threshold


def released(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` parsed anew from its own bytes. Protobuf keeps a parsed message's bytes in one
    arena that lives as long as any part of the message does: once its weights are moved out or
    cleared, the old message still holds their bytes (gigabytes for a full-scale backbone)."""
    return onnx.ModelProto.FromString(model.SerializeToString())
