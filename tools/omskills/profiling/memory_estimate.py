"""Predict ONNX Runtime's peak memory on the CPU for one call, from the graph alone, before running it.

A probe that runs a full-scale ViT backbone on a 4-frame batch materialises attention score
matrices of GBs each; finding out by letting the OOM killer end the child costs minutes and
pushes the machine to its limit. The graph already says how big every tensor of a call will be:

- weights: the initializers' (and Constant nodes') dims and dtypes, read without their data
  (`load_external_data=False`); plus what ONNX Runtime's constant folding adds at load: a node
  whose inputs are all constants is computed once and its output kept as a new initializer (the
  initializers only such nodes read are dropped) - a dynamo export's position encodings grow so;
  while folding, ONNX Runtime holds every tensor it computes (the load peak);
- activations: ONNX shape inference (`data_prop=True`, so Shape -> Gather -> Reshape chains
  resolve) with the graph inputs' symbolic dims ("s0", "batch") made the call's sizes, then a
  liveness walk over the nodes in graph (topological) order: a tensor is live from the node that
  makes it to its last reader (graph inputs for the whole call: the caller holds the feeds;
  graph outputs to the end); peak = the largest sum of live bytes over the steps. Outputs of
  Reshape/Squeeze/Unsqueeze/Flatten/Identity are views of their input in ONNX Runtime's CPU
  kernels: they extend their input's life rather than take new memory; a Mul/Div of a MatMul's
  output by a constant scalar (attention's scale) is folded into the MatMul by ONNX Runtime's
  MatMulScaleFusion, so its output takes the MatMul's buffer. Softmax and the activations are
  counted as writing a new buffer (ORT runs them in place only sometimes). Tensors inside If/Loop/
  Scan bodies and model-local functions are not counted (the names a body reads from outside
  are, as read by its node);
  tensors whose shape inference leaves partly unknown are skipped and counted.

graph estimate = max(weights + folded constants + activation peak, load peak). It leaves out
kernel scratch buffers (MLAS's working buffers, a MatMul's prepacked weights), the session's
fixed cost and the allocator's overhead: `benchmarks/memory_estimate_calibration.py` compares it
with what ONNX Runtime really takes, and `probe_need_bytes` adds what that calibration found (and
the probe child's imports). A model under 2 GB keeps its weights inline: loading it reads them
once, then their data is dropped (only dims and dtypes are kept).

The graph estimated is the one exported, even where `OnnxRuntimeBackend` fuses attention into
MultiHeadAttention (which never holds a score matrix): the backend goes back to the exported
graph when a fused block fails, and an over-prediction costs only a probe in chunks.

`probe_budget_bytes` is what a probe may use on this machine now, `choose_batch_chunk` the
largest batch chunk (among a candidate's ATC gears) whose predicted need fits in it, and
`plan_probe` that choice for a candidate's largest captured sample, as a `BatchSplit`.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from omskills.errors import InputError, OmskillsError, one_line
from omskills.records.base import Record
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.toolchain import BatchSplit
from pydantic import Field

GIB = 2**30
MIB = 2**20

# ONNX Runtime's CPU kernels for these ops alias their output to input 0 (no new buffer).
_VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
# Initializers with more values than this are weights, whose data no shape depends on.
_SHAPE_CONSTANT_MAX = 1024
# Ops ONNX Runtime does not fold even when every input is a constant.
_NOT_FOLDED = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Dropout",
        "QuantizeLinear",
        "DequantizeLinear",
    }
)
# How many of the largest tensors an estimate names.
_LARGEST = 5

METHOD = (
    "liveness walk over the nodes in graph order after ONNX shape inference with the call's input "
    "shapes: weights (initializers and Constants, from dims and dtypes) + what constant folding adds "
    "(tensors computed from constants only) + the most activation bytes "
    "live at one node (a tensor lives from its producer to its last reader; graph inputs for the "
    "whole call; Reshape/Squeeze/Unsqueeze/Flatten/Identity outputs are views of their input; a Mul/Div "
    "of a MatMul by a constant scalar writes into the MatMul's buffer, as ONNX Runtime fuses them), or the "
    "load peak (weights + every tensor constant folding computes) when more; "
    "tensors inside If/Loop/Scan bodies or model-local functions and kernel scratch buffers not counted"
)


class TensorSize(Record):
    """One intermediate tensor of a call, as shape inference sizes it."""

    name: str
    op: str = Field(description="Op type of the node that produces it ('input' for a graph input).")
    shape: list[int]
    dtype: str
    bytes: int


class MemoryEstimate(Record):
    """ONNX Runtime's predicted peak memory on the CPU for one call of a graph."""

    model: str = Field(description="The ONNX file estimated.")
    input_shapes: dict[str, list[int]] = Field(description="The call's input shapes the estimate is for.")
    weights_bytes: int = Field(description="Bytes of the initializers and Constant nodes, from their dims and dtypes.")
    folded_bytes: int = Field(
        description=(
            "Bytes ONNX Runtime's constant folding adds at load: tensors computed from constants only that other "
            "nodes read, kept as new initializers, less the initializers only folded nodes read."
        )
    )
    load_bytes: int = Field(
        description=(
            "Peak while ONNX Runtime loads the graph: weights_bytes + every tensor its constant folding computes."
        )
    )
    activation_bytes: int = Field(description="The most activation bytes live at one node (graph inputs included).")
    peak_bytes: int = Field(
        description="Predicted peak: weights_bytes + folded_bytes + activation_bytes, or load_bytes when more."
    )
    peak_at: str = Field(description="The node (name and op type) at which the most activation bytes are live.")
    largest: list[TensorSize] = Field(description="The largest activation tensors of the call, largest first.")
    unknown_shapes: int = Field(
        description="Activation tensors skipped because shape inference left their size unknown."
    )
    method: str = Field(description="How the estimate was made and what it leaves out.")

    def describe(self) -> str:
        top = self.largest[0] if self.largest else None
        biggest = f"; largest tensor {top.name} {top.shape} ({top.op}) {size_text(top.bytes)}" if top else ""
        skipped = f"; {self.unknown_shapes} tensors of unknown size skipped" if self.unknown_shapes else ""
        folded = f", folded constants {size_text(self.folded_bytes)}" if abs(self.folded_bytes) >= MIB // 100 else ""
        folded += (
            f" (load peak {size_text(self.load_bytes)})"
            if self.load_bytes > self.weights_bytes + self.folded_bytes
            else ""
        )
        return (
            f"graph estimate {size_text(self.peak_bytes)}: weights {size_text(self.weights_bytes)}{folded}, "
            f"activations {size_text(self.activation_bytes)} at {self.peak_at}{biggest}{skipped}"
        )


def size_text(count: int) -> str:
    """Bytes as GB (from 1 GB) or MB, two decimals."""
    return f"{count / GIB:.2f} GB" if count >= GIB else f"{count / MIB:.2f} MB"


class GraphMemory:
    """An ONNX graph without its weights' data, ready to estimate the peak of calls of any shape."""

    def __init__(self, path: str | Path) -> None:
        import onnx
        from omskills.onnxfiles.onnx_io import released

        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"model: {self.path} does not exist")
        try:
            self._model = onnx.load(str(self.path), load_external_data=False)
        except Exception as err:  # protobuf's DecodeError and onnx's own errors
            raise InputError(f"model: {self.path} is not a readable ONNX file ({one_line(err)})") from err
        graph = self._model.graph
        self._static = {init.name for init in graph.initializer} | {
            init.values.name for init in graph.sparse_initializer
        }
        self._static |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
        self._scalars = _static_scalars(self._model)
        self._constant_bytes = _constant_bytes(self._model)
        self.weights_bytes = sum(self._constant_bytes.values())
        _drop_weight_data(self._model)
        self._model = released(self._model)
        self.input_names = [value.name for value in graph.input if value.name not in self._static]

    def estimate(self, input_shapes: Mapping[str, Sequence[int]]) -> MemoryEstimate:
        """The predicted peak of a call with these input shapes (graph input name -> shape)."""
        shapes = {name: [int(size) for size in shape] for name, shape in input_shapes.items()}
        unknown = sorted(set(shapes) - set(self.input_names))
        if unknown:
            raise InputError(f"input_shapes: {unknown} are not inputs of {self.path.name} (inputs: {self.input_names})")
        graph = self._inferred(shapes).graph
        sizes = _tensor_sizes(graph)
        steps = list(graph.node)
        producer = {out: node.op_type for node in steps for out in node.output if out}
        folded, folded_bytes, folding_bytes = _folded(graph, steps, self._static, self._constant_bytes, sizes)
        buffers, unknown_count = _buffers(graph, steps, self._static | folded, self._scalars, sizes)
        activation, peak_step = _live_peak(buffers, len(steps))
        largest = sorted(buffers, key=lambda b: -b.size.bytes)[:_LARGEST]
        at = steps[peak_step] if steps else None
        return MemoryEstimate(
            model=str(self.path),
            input_shapes=shapes,
            weights_bytes=self.weights_bytes,
            folded_bytes=folded_bytes,
            load_bytes=self.weights_bytes + folding_bytes,
            activation_bytes=activation,
            peak_bytes=max(self.weights_bytes + folded_bytes + activation, self.weights_bytes + folding_bytes),
            peak_at=f"{at.name or '(unnamed)'} ({at.op_type})" if at else "(no nodes)",
            largest=[b.size.model_copy(update={"op": producer.get(b.size.name, "input")}) for b in largest],
            unknown_shapes=unknown_count,
            method=METHOD,
        )

    def _inferred(self, shapes: Mapping[str, list[int]]):
        import onnx

        model = onnx.ModelProto()
        model.CopyFrom(self._model)  # no weight data in it: cheap
        graph = model.graph
        for value in graph.input:
            if value.name in shapes:
                _make_concrete(value, shapes[value.name])
        # What the exporter inferred with symbolic dims would stand against the concrete sizes.
        del graph.value_info[:]
        for value in graph.output:
            value.type.tensor_type.ClearField("shape")
        try:
            from omskills.onnxfiles.inspect import infer_with_data_prop

            return infer_with_data_prop(model)
        except Exception as err:
            raise OmskillsError(
                f"{self.path.name}: ONNX shape inference failed for {dict(shapes)} ({one_line(err)})"
            ) from err


def estimate_peak(path: str | Path, input_shapes: Mapping[str, Sequence[int]]) -> MemoryEstimate:
    """ONNX Runtime's predicted peak on the CPU for one call of the graph at `path` (see the module doc)."""
    return GraphMemory(path).estimate(input_shapes)


# -- the graph's sizes ---------------------------------------------------------------------------


class _Buffer:
    """Memory one tensor takes, live from step `born` to step `dies` (views extend it)."""

    __slots__ = ("size", "born", "dies")

    def __init__(self, size: TensorSize, born: int, dies: int) -> None:
        self.size, self.born, self.dies = size, born, dies


def _make_concrete(value, shape: list[int]) -> None:
    dims = value.type.tensor_type.shape.dim
    if len(dims) != len(shape):
        raise InputError(
            f"input_shapes[{value.name!r}]: {shape} has rank {len(shape)}; the graph declares rank {len(dims)}"
        )
    for dim, size in zip(dims, shape):
        dim.Clear()
        dim.dim_value = size


def _itemsize(elem_type: int) -> int | None:
    import onnx

    if elem_type in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING):
        return None
    try:
        return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except (KeyError, TypeError, ValueError):
        return None


def _dtype_name(elem_type: int) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(elem_type).lower()


def _constant_bytes(model) -> dict[str, int]:
    """Initializer or Constant output -> its bytes, from dims and dtypes (no data read)."""
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer} | {
        sparse.values.name: sparse.values for sparse in graph.sparse_initializer
    }
    tensors |= {
        node.output[0]: attr.t
        for node in graph.node
        if node.op_type == "Constant" and node.output
        for attr in node.attribute
        if attr.name == "value"
    }
    return {name: math.prod(t.dims) * (_itemsize(t.data_type) or 0) for name, t in tensors.items()}


def _folded(
    graph, steps, static: set[str], constant_bytes: Mapping[str, int], sizes: Mapping[str, TensorSize]
) -> tuple[set[str], int, int]:
    """What ONNX Runtime's constant folding does at load: the tensors computed from constants only
    (they are no activation of a call); the bytes it adds: the folded tensors other nodes read
    (kept as new initializers) less the initializers only folded nodes read (dropped); and the
    bytes of every folded tensor (the pass keeps each one until it ends)."""
    folded: set[str] = set()
    folding: list[bool] = []
    for node in steps:
        inputs = [name for name in node.input if name]
        foldable = (
            node.op_type not in _NOT_FOLDED
            and not _outer_names(node)
            and inputs
            and all(name in static or name in folded for name in inputs)
        )
        folding.append(bool(foldable))
        if foldable:
            folded.update(out for out in node.output if out)
    read_by: dict[str, list[bool]] = {}
    for node, foldable in zip(steps, folding):
        for name in {n for n in node.input if n} | _outer_names(node):
            read_by.setdefault(name, []).append(foldable)
    outputs = {value.name for value in graph.output}
    kept = [name for name in folded if name in outputs or not all(read_by.get(name, [True]))]
    dropped = [name for name in constant_bytes if name not in outputs and read_by.get(name) and all(read_by[name])]
    added = sum(sizes[name].bytes for name in kept if name in sizes) - sum(constant_bytes[n] for n in dropped)
    return folded, added, sum(sizes[name].bytes for name in folded if name in sizes)


def _drop_weight_data(model) -> None:
    """Forget the data of initializers a model under protobuf's 2 GB limit keeps inline (only
    their dims and dtypes matter here), so that each estimate's copy is small; the small ones
    stay, as shape inference reads shape constants' values."""
    for tensor in model.graph.initializer:
        if math.prod(tensor.dims) > _SHAPE_CONSTANT_MAX:
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(field)


def _static_scalars(model) -> set[str]:
    """Names of the initializers and Constant outputs that hold one value."""
    names = {t.name for t in model.graph.initializer if math.prod(t.dims) == 1}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            attr = node.attribute[0] if node.attribute else None
            if attr is not None and (
                attr.name in ("value_float", "value_int") or (attr.name == "value" and math.prod(attr.t.dims) == 1)
            ):
                names.add(node.output[0])
    return names


def _tensor_sizes(graph) -> dict[str, TensorSize]:
    """Name -> size for every tensor whose dtype and dims shape inference made fully known."""
    sizes = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        itemsize = _itemsize(tensor.elem_type) if value.type.HasField("tensor_type") else None
        if itemsize is None or not tensor.HasField("shape"):
            continue
        dims = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim]
        if any(size is None for size in dims):
            continue
        sizes[value.name] = TensorSize(
            name=value.name, op="", shape=dims, dtype=_dtype_name(tensor.elem_type), bytes=math.prod(dims) * itemsize
        )
    return sizes


def _outer_names(node) -> set[str]:
    """Names an If/Loop/Scan body reads, at any depth (outer-scope tensors among them)."""
    names: set[str] = set()
    for attr in node.attribute:
        for body in [attr.g] if attr.HasField("g") else list(attr.graphs):
            for inner in body.node:
                names.update(n for n in inner.input if n)
                names |= _outer_names(inner)
    return names


def _buffers(
    graph, steps, static: set[str], scalars: set[str], sizes: Mapping[str, TensorSize]
) -> tuple[list[_Buffer], int]:
    """Each activation's buffer with its live range over the steps, and how many were of unknown size."""
    owner, live, held = _live_ranges(graph, steps, static)
    merged = _in_place(steps, owner, live, held, sizes, scalars)
    buffers, unknown = [], 0
    for name, (born, dies) in live.items():
        if name in merged:
            continue
        if name in sizes:
            buffers.append(_Buffer(sizes[name], born, dies))
        else:
            unknown += 1
    return buffers, unknown


def _live_ranges(graph, steps, static: set[str]) -> tuple[dict[str, str], dict[str, list[int]], set[str]]:
    """Which buffer each tensor is (itself, or the one it views), each buffer's [born, dies] step,
    and the buffers held beyond the graph (its inputs and outputs)."""
    last = max(len(steps) - 1, 0)
    owner: dict[str, str] = {}
    live: dict[str, list[int]] = {}
    inputs = [value.name for value in graph.input if value.name not in static]
    for name in inputs:
        owner[name] = name
        live[name] = [0, last]  # the caller holds its feeds for the whole call
    for step, node in enumerate(steps):
        if all(out in static for out in node.output if out):
            continue  # a Constant, or a node ONNX Runtime folds at load
        for name in {n for n in node.input if n} | _outer_names(node):
            if name in owner:
                live[owner[name]][1] = max(live[owner[name]][1], step)
        for index, out in enumerate(node.output):
            if not out:
                continue
            source = node.input[0] if node.input else ""
            if index == 0 and node.op_type in _VIEW_OPS and source in owner:
                owner[out] = owner[source]
            else:
                owner[out] = out
                live[out] = [step, step]
    outputs = {owner[value.name] for value in graph.output if value.name in owner}
    for name in outputs:
        live[name][1] = last
    return owner, live, set(inputs) | outputs


def _in_place_source(node, producer: Mapping[str, str], scalars: set[str]) -> str | None:
    """The input whose buffer this node's output takes over in ONNX Runtime, if any: the MatMul
    output that a Mul/Div by a constant scalar scales (ORT's MatMulScaleFusion folds the scale
    into the MatMul, which then writes the scaled result).

    Softmax and the activations declare that they may run in place, but whether ORT's planner
    lets them depends on how it reused the input's buffer (measured: a second attention block's
    Softmax took a new buffer, the first's did not); they are counted as taking a new one."""
    if node.op_type in ("Mul", "Div") and len(node.input) == 2:
        operands = [name for name in node.input if name not in scalars]
        if len(operands) == 1 and len(scalars & set(node.input)) == 1 and producer.get(operands[0]) == "MatMul":
            return operands[0]
    return None


def _in_place(
    steps,
    owner: dict[str, str],
    live: dict[str, list[int]],
    held: set[str],
    sizes: Mapping[str, TensorSize],
    scalars: set[str],
) -> set[str]:
    """Let outputs take over an input's buffer where ONNX Runtime would (`_in_place_source`; the
    input dies at that node and has the output's size); returns the buffers merged away."""
    merged: set[str] = set()
    into: dict[str, str] = {}  # merged buffer -> the buffer that took it over

    def root(name: str) -> str:
        while name in into:
            name = into[name]
        return name

    producer = {out: node.op_type for node in steps for out in node.output if out}
    for step, node in enumerate(steps):
        source = _in_place_source(node, producer, scalars)
        out = node.output[0] if node.output else ""
        if source is None or source not in owner or owner.get(out) != out:
            continue
        buffer = root(owner[source])
        fits = buffer in sizes and out in sizes and sizes[buffer].bytes == sizes[out].bytes
        if fits and buffer not in held and live[buffer][1] == step:
            live[buffer][1] = live[out][1]
            into[out] = buffer
            merged.add(out)
            if out in held:
                held.add(buffer)
    return merged


def _live_peak(buffers: Sequence[_Buffer], steps: int) -> tuple[int, int]:
    """The most bytes live at one step, and that step."""
    change = [0] * (max(steps, 1) + 1)
    for buffer in buffers:
        change[buffer.born] += buffer.size.bytes
        change[buffer.dies + 1] -= buffer.size.bytes
    best, best_step, running = 0, 0, 0
    for step in range(max(steps, 1)):
        running += change[step]
        if running > best:
            best, best_step = running, step
    return best, best_step


# -- samples ---------------------------------------------------------------------------------------


class SampleSizes(Record):
    """The shapes of one captured sample's tensors, read from its npz headers (no data loaded)."""

    path: str
    inputs: dict[str, list[int]]
    input_bytes: int
    output_bytes: int  # the reference outputs the probe holds beside ONNX Runtime's


def sample_sizes(path: str | Path) -> SampleSizes:
    """Shapes and bytes of a sample file written by `omskills.contracts.samples.save_sample`."""
    from omskills.contracts.samples import INPUT_PREFIX, OUTPUT_PREFIX, array_headers

    inputs: dict[str, list[int]] = {}
    bytes_of = {INPUT_PREFIX: 0, OUTPUT_PREFIX: 0}
    try:
        headers = array_headers(Path(path))
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise InputError(f"sample {path}: cannot read its array headers ({one_line(err)})") from err
    for key, (shape, dtype) in headers.items():
        prefix = next((p for p in bytes_of if key.startswith(p)), None)
        if prefix is None:
            continue
        bytes_of[prefix] += math.prod(shape) * dtype.itemsize
        if prefix == INPUT_PREFIX:
            inputs[key.removeprefix(prefix)] = list(shape)
    return SampleSizes(
        path=str(path), inputs=inputs, input_bytes=bytes_of[INPUT_PREFIX], output_bytes=bytes_of[OUTPUT_PREFIX]
    )


# -- the probe's budget and batch chunk ------------------------------------------------------------

# What a probe takes beyond the estimate, from benchmarks/memory_estimate_calibration.py (ONNX
# Runtime 1.32 on CPU, no arena; measured peak RSS over the graph estimate, per part):
# - activations: 1.09x per batch item (an SDPA attention block) to 1.71x (a tiny ViT vision
#   backbone, two runs: the allocator keeps part of the first run's memory), 2.30x on a graph with
#   an Einsum (its scratch copies are not in the graph); 0.56x where ORT ran Softmax in place;
ACTIVATION_FACTOR = 2.0
# - weights and folded constants: up to 1.16x (prepacked MatMul weights); load peak 1.08x;
WEIGHT_FACTOR = 1.25
# - a session costs 31-67 MB beyond its weights before it runs, whatever the model;
SESSION_BYTES = 96 * MIB
# - the probe's child imports omskills.stages.toolchain (torch, onnx, onnxruntime): 610 MB RSS;
CHILD_BYTES = 640 * MIB
# Memory left alone, as a share of the machine's RAM: other processes (a shared machine, the
# parent waiting on its child) may grow while the probe runs, `available` counts page cache the
# kernel cannot always drop at once, and the OOM killer acts before available reaches zero.
SAFETY_SHARE = 0.10


def probe_budget_bytes() -> int:
    """What a probe child may take now: available memory less SAFETY_SHARE of the RAM. Nothing
    else is taken off: the probe runs in its own child after the parent released its PyTorch model."""
    import psutil

    memory = psutil.virtual_memory()
    return max(int(memory.available - SAFETY_SHARE * memory.total), 0)


def session_need_bytes(estimate: MemoryEstimate) -> int:
    """What ONNX Runtime's session takes at its peak for this call: the estimate's parts with the
    calibrated factors, and the session's fixed cost."""
    resident = (estimate.weights_bytes + estimate.folded_bytes) * WEIGHT_FACTOR
    running = resident + estimate.activation_bytes * ACTIVATION_FACTOR
    return int(max(running, estimate.load_bytes * WEIGHT_FACTOR)) + SESSION_BYTES


def probe_need_bytes(estimate: MemoryEstimate, held_bytes: int = 0) -> int:
    """What a probe child running this call needs: the session's (`session_need_bytes`), the
    child's imports, and `held_bytes` the probe holds beside ONNX Runtime (reference outputs,
    whole-batch feeds)."""
    return session_need_bytes(estimate) + CHILD_BYTES + held_bytes


class ChunkChoice(Record):
    """The largest batch chunk whose predicted need fits a budget."""

    batch: int | None = Field(description="Items of the call's batch; null when no input of the call is batched.")
    budget_bytes: int
    whole: MemoryEstimate = Field(description="The estimate for the whole batch.")
    whole_bytes: int = Field(description="The probe's predicted need for the whole batch (probe_need_bytes).")
    chunk: int | None = Field(None, description="The chunk size chosen; null when the whole batch fits.")
    chunk_bytes: int | None = Field(None, description="The probe's predicted need in chunks of that size.")
    fits: bool = Field(description="Whether the whole batch, or the chosen chunk, fits the budget.")


def choose_batch_chunk(
    graph: GraphMemory,
    input_shapes: Mapping[str, Sequence[int]],
    batch_axes: Mapping[str, int],
    sizes: Sequence[int],
    budget_bytes: int,
    sample: SampleSizes | None = None,
) -> ChunkChoice:
    """The largest of `sizes` (chunk sizes below the call's batch, e.g. a candidate's ATC gears)
    whose predicted need fits `budget_bytes`, or the smallest when none does (fits=False).

    Each size is estimated on its own shapes (weights do not scale with the batch). Beside ONNX
    Runtime the probe holds the sample's reference outputs; in chunks also the whole-batch feeds
    and the chunks' outputs with their concatenation.
    """
    batched = {name: axis for name, axis in batch_axes.items() if name in input_shapes}
    batches = {input_shapes[name][axis] for name, axis in batched.items()}
    if len(batches) > 1:
        raise InputError(f"batch_axes: the inputs {sorted(batched)} disagree on the batch size in {dict(input_shapes)}")
    batch = batches.pop() if batches else None  # None: no input of the call is batched
    outputs = sample.output_bytes if sample else 0
    whole = graph.estimate(input_shapes)
    whole_bytes = probe_need_bytes(whole, outputs)
    choice = ChunkChoice(
        batch=batch, budget_bytes=budget_bytes, whole=whole, whole_bytes=whole_bytes, fits=whole_bytes <= budget_bytes
    )
    candidates = sorted({size for size in sizes if batch is not None and 1 <= size < batch}, reverse=True)
    if choice.fits or not candidates:
        return choice
    held = (sample.input_bytes if sample else 0) + 3 * outputs
    for size in candidates:
        shapes = {
            name: [size if name in batched and axis == batched[name] else dim for axis, dim in enumerate(shape)]
            for name, shape in input_shapes.items()
        }
        need = probe_need_bytes(graph.estimate(shapes), held)
        choice = choice.model_copy(update={"chunk": size, "chunk_bytes": need, "fits": need <= budget_bytes})
        if choice.fits:
            break
    return choice


class ProbePlan(Record):
    """How to probe a candidate, decided from its predicted peak."""

    split: BatchSplit | None = Field(None, description="The batch split to probe with; null: the whole batch.")
    note: str = Field(description="What was predicted and decided, for the record's decision log.")


def plan_probe(
    path: str | Path,
    sample_paths: Sequence[Path],
    contract: ContractSpec,
    strategy: ShapeStrategy | None,
    budget_bytes: int,
) -> ProbePlan:
    """Whether the largest captured sample's call fits `budget_bytes` whole, else the batch split
    (chunks among the candidate's ATC batch gears) whose predicted peak fits.

    The estimate is of the graph as exported, as the probe runs it (its session fuses nothing)."""
    from omskills.runtime.batch_split import batch_split_for

    graph = GraphMemory(path)
    sample = max((sample_sizes(p) for p in sample_paths), key=lambda s: s.input_bytes)
    shapes = {name: shape for name, shape in sample.inputs.items() if name in graph.input_names}
    template = batch_split_for(contract, strategy, 1, "")
    gears = [gear[0] for gear in strategy.gears] if template and strategy else []
    choice = choose_batch_chunk(graph, shapes, template.input_axes if template else {}, gears, budget_bytes, sample)
    call = f"on a batch of {choice.batch}" if choice.batch is not None else "for the call"
    whole = (
        f"predicted peak {choice.whole_bytes / GIB:.2f} GB {call} "
        f"{'<=' if choice.whole_bytes <= budget_bytes else '>'} budget {budget_bytes / GIB:.2f} GB"
    )
    detail = f" ({choice.whole.describe()}; sample {Path(sample.path).name})"
    probed = "the whole batch" if choice.batch is not None else "the call whole"
    if choice.whole_bytes <= budget_bytes:
        return ProbePlan(note=f"{whole}: probing {probed}{detail}")
    if choice.chunk is None:
        why = (
            "the batch cannot be split (no dynamic_batch_size strategy with outputs that follow the batch, "
            "or no smaller gear)"
        )
        return ProbePlan(note=f"{whole}; {why}: probing {probed}{detail}")
    over = "" if choice.fits else " (still over the budget: the smallest gear)"
    reason = (
        f"{whole}; chunks of {choice.chunk} predicted {choice.chunk_bytes / GIB:.2f} GB{over}{detail}; "
        "the chunks' outputs are compared with PyTorch's whole-batch run"
    )
    split = batch_split_for(contract, strategy, choice.chunk, reason)
    return ProbePlan(split=split, note=reason)


# -- a whole adaptation's process tree, before it runs ----------------------------------------------


class AdaptationMemory(Record):
    """What an adaptation's whole process tree may take at its peak, predicted before it runs from
    its model as its driver builds it (`omskills fleet` measures the parts in a fresh
    process). At the peak (verify, or a probe in a child) the tree holds:

    - the `adapt` client, which imported the driver to check the record: `imports_bytes`;
    - the tool server, which imported ONNX Runtime and built the model: `loaded_bytes`;
    - ONNX Runtime sessions of the exported graphs beside it, at most the model's weights again
      (`session_need_bytes` of the weights: the calibrated factor and a session's fixed cost).

    The main path's activations are not in it (only the study measures them): `omskills fleet`
    adds a margin, and asks for the study's measured peak once there is one."""

    scale: str = Field(description="The scale the model was built at.")
    imports_bytes: int = Field(description="RSS of a fresh process that imported the driver (the `adapt` client).")
    loaded_bytes: int = Field(
        description="Peak RSS of that process once it imported ONNX Runtime and built the model (the tool server)."
    )
    weights_bytes: int = Field(description="Bytes of the model's parameters and buffers.")
    sessions_bytes: int = Field(description="ONNX Runtime sessions holding the weights again (session_need_bytes).")
    need_bytes: int = Field(description="imports_bytes + loaded_bytes + sessions_bytes.")


def adaptation_memory(scale: str, imports_bytes: int, loaded_bytes: int, weights_bytes: int) -> AdaptationMemory:
    """The tree's predicted peak from what a fresh process measured importing the driver and building the model."""
    sessions = int(weights_bytes * WEIGHT_FACTOR) + SESSION_BYTES
    return AdaptationMemory(
        scale=scale,
        imports_bytes=imports_bytes,
        loaded_bytes=loaded_bytes,
        weights_bytes=weights_bytes,
        sessions_bytes=sessions,
        need_bytes=imports_bytes + loaded_bytes + sessions,
    )
