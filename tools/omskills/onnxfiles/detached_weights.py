"""Rewrite a big ONNX model's graph without holding its weights.

A full-scale backbone is 2 GB of weights around a few thousand nodes. onnxslim and
auto_optimizer load every weight, copy the graph per pass or per knowledge and serialise it
again for shape inference: 150 s and 15 GB for a graph whose structure is a few MB. Neither
needs the weights' values to fuse, clean up or fold the shape arithmetic, so the weights are
detached first: their bytes go to the variant's own `.data` file (copied by the file system
when the original keeps them in one, written tensor by tensor when they are inline), and each
becomes a graph input of the same name, type and shape, which no optimiser folds, ties or
copies. `attach` turns those inputs back into initializers that read the variant's file.

What is given up: rewrites that need a weight's value (folding a transposed weight, fusing
a BatchNorm into its Conv). ONNX Runtime and ATC do those themselves when they load the graph.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
from omskills.onnxfiles.onnx_io import EXTERNAL_TENSOR_MIN_BYTES, released
from omskills.records.deploy import external_data_path
from onnx import TensorProto, helper


def _is_weight(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL or len(tensor.raw_data) >= EXTERNAL_TENSOR_MIN_BYTES


def _set_location(tensor: TensorProto, location: str, offset: int | None = None, length: int | None = None) -> None:
    entries = {e.key: e.value for e in tensor.external_data}
    entries["location"] = location
    if offset is not None:
        entries |= {"offset": str(offset), "length": str(length)}
    del tensor.external_data[:]
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)
    tensor.data_location = TensorProto.EXTERNAL


def detach(source: Path, target: Path) -> tuple[onnx.ModelProto, dict[str, str]]:
    """`source`'s graph with its weights (initializers in its data file, inline ones of
    EXTERNAL_TENSOR_MIN_BYTES and more) moved to graph inputs, their bytes in `target`'s data
    file. Returns the light model and the detached weights (name -> serialised external
    TensorProto, a few hundred bytes each). Small constants stay: they are the shape arithmetic
    an optimiser folds."""
    model = onnx.load(str(source), load_external_data=False)
    data = external_data_path(target)
    data.unlink(missing_ok=True)
    if external_data_path(source).exists():
        shutil.copyfile(external_data_path(source), data)
    weights = [t for t in model.graph.initializer if _is_weight(t)]
    for tensor in weights:
        if tensor.data_location == TensorProto.EXTERNAL:
            _set_location(tensor, data.name)
    move_inline_weights(model, data)
    if data.exists() and not data.stat().st_size:
        data.unlink()
    detached = {t.name: t.SerializeToString() for t in weights}
    kept = [t for t in model.graph.initializer if t.name not in detached]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in weights)
    return released(model), detached


def move_inline_weights(model: onnx.ModelProto, data: Path) -> None:
    """Inline weights (EXTERNAL_TENSOR_MIN_BYTES and more) appended to `data`, in place: each
    initializer then reads its bytes there (a location relative to the model's folder, so the
    model must be saved or run beside `data`)."""
    inline = [t for t in model.graph.initializer if t.data_location != TensorProto.EXTERNAL and _is_weight(t)]
    if not inline:
        return
    with open(data, "ab") as handle:
        for tensor in inline:
            offset = handle.tell()
            handle.write(tensor.raw_data)
            _set_location(tensor, data.name, offset, len(tensor.raw_data))
            tensor.ClearField("raw_data")


def attach(model: onnx.ModelProto, detached: dict[str, str]) -> onnx.ModelProto:
    """The inputs `detach` made turned back into initializers reading the variant's data file,
    in place. Weights the rewrite no longer uses went with their input."""
    graph = model.graph
    used = [i.name for i in graph.input if i.name in detached]
    inputs = [i for i in graph.input if i.name not in detached]
    del graph.input[:]
    graph.input.extend(inputs)
    for name in used:
        graph.initializer.add().ParseFromString(detached[name])
    return model


def discard(target: Path) -> None:
    """Remove what `detach` wrote for a variant that is not saved."""
    external_data_path(target).unlink(missing_ok=True)
