"""Read what an ONNX file declares — I/O, opsets, operators, size, external data — without
loading its weights (a multi-GB backbone is summarised in well under a second)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from omskills.errors import InputError
from omskills.files import inside_without_links
from omskills.onnxfiles.onnx_io import all_tensors
from omskills.records.toolchain import ExternalDataInfo, OnnxSummary, OnnxTensorInfo
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto
from onnx.external_data_helper import load_external_data_for_model

DEFAULT_DOMAIN = "ai.onnx"
UNDECLARED_DIM = "?"


def load_model_proto(path: str | Path, load_weights: bool = False) -> ModelProto:
    """Load an ONNX model or raise InputError naming the file and what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"ONNX file not found: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as err:
        raise InputError(f"not a readable ONNX model: {path} ({type(err).__name__}: {err})") from None
    # Protobuf accepts many byte strings as an (almost empty) message; a real model has an IR
    # version and a graph.
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise InputError(f"not a valid ONNX model: {path} (no IR version or no graph)")
    external_locations(model, path)
    if load_weights:
        try:
            load_external_data_for_model(model, str(path.parent))
        except (ValueError, RuntimeError, OSError) as err:
            raise InputError(f"{path}: its external weights cannot be read ({type(err).__name__}: {err})") from None
    return model


def external_locations(model: ModelProto, path: Path) -> list[str]:
    """The external-data files `model` (stored at `path`) names, each checked to lie in the
    model's folder through no symbolic link: a location like `../../etc/shadow` would have a
    tool read, or report the size of, a file outside the workspace."""
    locations: list[str] = []
    for tensor in all_tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location", "")
        for key in ("offset", "length"):
            if key in entries and not entries[key].isdigit():  # isdigit: no sign, no space, no dot
                raise InputError(
                    f"{path}: tensor {tensor.name!r}: external data {key} {entries[key][:40]!r} is not a byte count"
                )
        if location in locations:
            continue
        try:
            inside_without_links(path.parent, location)
        except ValueError as err:
            raise InputError(f"{path}: tensor {tensor.name!r} names external data {location!r}: {err}") from None
        locations.append(location)
    return locations


def inspect_onnx(path: str | Path) -> OnnxSummary:
    """Summarise an ONNX file: I/O with symbolic dims, opsets, IR version, operator
    histogram, node count, file size and external data."""
    path = Path(path)
    model = load_model_proto(path)
    graph = model.graph
    inputs = [tensor_info(v) for v in graph.input if v.name not in _initializer_names(graph)]
    outputs = [tensor_info(v) for v in graph.output]
    histogram = Counter(op_key(node) for node, _ in walk_nodes(graph))
    main_nodes = len(graph.node)
    external = external_data_info(model, path.parent)
    file_bytes = path.stat().st_size
    return OnnxSummary(
        path=str(path),
        file_bytes=file_bytes,
        total_bytes=file_bytes + external.bytes,
        ir_version=model.ir_version,
        producer=" ".join(p for p in (model.producer_name, model.producer_version) if p) or None,
        opsets={(o.domain or DEFAULT_DOMAIN): o.version for o in model.opset_import},
        inputs=inputs,
        outputs=outputs,
        symbolic_dims=sorted(
            {d for t in inputs + outputs for d in (t.shape or []) if isinstance(d, str) and d != UNDECLARED_DIM}
        ),
        node_count=main_nodes,
        subgraph_node_count=sum(histogram.values()) - main_nodes,
        op_histogram=dict(sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0]))),
        local_functions=[f"{f.domain}::{f.name}" for f in model.functions],
        initializer_count=len(graph.initializer),
        external_data=external,
    )


def default_opset(model: ModelProto) -> int | None:
    """The version of the default ONNX domain, which ATC's parser keys operators on."""
    for opset in model.opset_import:
        if opset.domain in ("", DEFAULT_DOMAIN):
            return opset.version
    return None


# ONNX's data propagation turns each 1-D tensor's values into dims of a shape, also for a long
# vector that is data, not a shape (an audio signal): 2.4 GB and 6 s for ten Casts of 10^6 floats.
DATA_PROP_MAX_VECTOR = 4096


def inferred_shapes(model: ModelProto, data_prop: bool = False) -> dict[str, list[int | str]]:
    """Every tensor's shape as ONNX shape inference sees it: sizes, dim names, "?" where unknown.
    `data_prop`: shapes computed in the graph (Shape, Gather, Concat feeding a Reshape, as exporters
    write attention) are followed too, unless the graph has a vector longer than
    DATA_PROP_MAX_VECTOR; where that inference fails, the plain one answers."""
    if not data_prop:
        return _shapes_of(onnx.shape_inference.infer_shapes(model))
    try:
        return _shapes_of(infer_with_data_prop(model))
    except Exception:  # noqa: BLE001 - data propagation is stricter than plain inference
        return _shapes_of(onnx.shape_inference.infer_shapes(model))


def infer_with_data_prop(model: ModelProto, strict_mode: bool = False) -> ModelProto:
    """ONNX shape inference with data propagation, or without it where the graph has a vector
    longer than DATA_PROP_MAX_VECTOR."""
    plain = onnx.shape_inference.infer_shapes(model, strict_mode=strict_mode)
    if _long_vectors(plain):
        return plain
    return onnx.shape_inference.infer_shapes(model, strict_mode=strict_mode, data_prop=True)


def _shapes_of(inferred: ModelProto) -> dict[str, list[int | str]]:
    infos = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    return {
        info.name: [
            d.dim_value if d.HasField("dim_value") else d.dim_param or UNDECLARED_DIM
            for d in info.type.tensor_type.shape.dim
        ]
        for info in infos
    }


def _long_vectors(inferred: ModelProto) -> bool:
    return any(
        len(dims) == 1 and isinstance(dims[0], int) and dims[0] > DATA_PROP_MAX_VECTOR
        for dims in _shapes_of(inferred).values()
    )


def op_key(node: NodeProto) -> str:
    return node.op_type if node.domain in ("", DEFAULT_DOMAIN) else f"{node.domain}::{node.op_type}"


def walk_nodes(graph: GraphProto) -> Iterator[tuple[NodeProto, int]]:
    """Every node with its subgraph depth (0 = main graph), including If/Loop/Scan bodies."""
    for node in graph.node:
        yield node, 0
        for attribute in node.attribute:
            bodies = list(attribute.graphs)
            if attribute.HasField("g"):
                bodies.append(attribute.g)
            for body in bodies:
                for inner, depth in walk_nodes(body):
                    yield inner, depth + 1


def tensor_info(value: ValueInfoProto) -> OnnxTensorInfo:
    tensor_type = value.type.tensor_type
    dtype = "unknown"
    if tensor_type.elem_type:
        dtype = str(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
    shape: list[int | str] | None = None
    if tensor_type.HasField("shape"):
        shape = [_dim(d) for d in tensor_type.shape.dim]
    return OnnxTensorInfo(name=value.name, dtype=dtype, shape=shape)


def _dim(dim: onnx.TensorShapeProto.Dimension) -> int | str:
    if dim.HasField("dim_value"):
        return dim.dim_value
    if dim.HasField("dim_param") and dim.dim_param:
        return dim.dim_param
    return UNDECLARED_DIM


def _initializer_names(graph: GraphProto) -> set[str]:
    # IR < 4 lists initializers among the inputs; they are weights, not feeds.
    return {init.name for init in graph.initializer}


def external_data_info(model: ModelProto, folder: Path) -> ExternalDataInfo:
    """Files and bytes of tensors stored outside the .onnx file (weights were not loaded); the
    locations are checked by `external_locations`."""
    lengths: Counter[str] = Counter()
    files: list[str] = []
    for tensor in all_tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location", "")
        if location not in files:
            files.append(location)
        if "length" in entries:
            lengths[location] += int(entries["length"])
    missing = [f for f in files if not (folder / f).is_file()]
    total = 0
    for f in files:
        # A tensor without a recorded length runs to the end of its file.
        if f in lengths:
            total += lengths[f]
        elif f not in missing:
            total += (folder / f).stat().st_size
    return ExternalDataInfo(files=files, bytes=total, missing=missing)


def graph_inputs(path: str | Path) -> list[str]:
    """The inputs a caller feeds, in the graph's order (initializers listed as inputs are not fed)."""
    graph = load_model_proto(path).graph
    weights = _initializer_names(graph)
    return [i.name for i in graph.input if i.name not in weights]
