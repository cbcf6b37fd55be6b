"""Calibration before any emulation: one fp32 pass of a graph on a recorded call, reading the
largest magnitude of every float tensor, the depth of its mean reductions and the shapes of its
Cube operators, and the nodes whose values leave fp16's useful range kept at their original
dtype up front (as NVIDIA ModelOpt's AutoCast does from one reference run).

The emulation rounds every fp16 node's inputs and outputs and computes in fp32 between them, so an
output beyond fp16's range shows there too; what it cannot see is the arithmetic inside an
operator, and inputs larger than the one recorded. The rules, each with its limit:

- overflow: a node's output or input reaches FP16_MAX (65504), the largest finite fp16: it becomes
  inf where it is written in fp16, and where an fp16 node reads it (ATC casts a kept node's fp32
  output to fp16 for its fp16 consumers), so the node and its readers are kept.
- headroom: a node's output reaches HEADROOM (16384, a quarter of fp16's range): two doublings
  from overflow, the margin left for inputs larger than the recorded one (ModelOpt's default is
  512 for GPU kernels that may compute in fp16 throughout; Ascend's Cube accumulates in fp32).
- squares: an operator that squares its input inside (normalisations, ReduceSumSquare, ReduceL2,
  Pow) reads a magnitude of SQUARE_LIMIT (256) or more: 256^2 = 65536 is beyond fp16.
- mean_of_large_sum: a mean (ReduceMean, GlobalAveragePool) whose output magnitude times its
  depth (the elements it averages) reaches FP16_MAX: a sum accumulated in fp16 would overflow
  before the division.
- weight_range: a weight beyond FP16_MAX, which ATC clips to +-65504 before casting
  (`--is_weight_clip`, its default): the value changes silently; its consumers are kept.
- constant_underflow: a small constant every non-zero value of which rounds to 0 in fp16 (below
  2^-25, half of fp16's smallest subnormal), such as an epsilon of 1e-12: its consumers are kept.

The same pass gives the graph's fp32 outputs (the reference the emulated modes are compared with)
and its Cube multiply-accumulates (`cube_macs`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from omskills.ascend.attention_heads import sliced_from, split_attention_heads
from omskills.ascend.emulation import PreparedGraph, run_beside
from omskills.ascend.precision_modes import CUBE_OPS, FP16_MAX
from omskills.onnxfiles.onnx_io import EXTERNAL_TENSOR_MIN_BYTES
from omskills.records.precision import CalibrationKeep, GraphCalibration
from onnx import NodeProto, TensorProto, helper, numpy_helper

HEADROOM = 16384.0
SQUARE_LIMIT = 256.0
UNDERFLOW = 2.0**-25
SQUARING_OPS = frozenset(
    {
        "LayerNormalization",
        "InstanceNormalization",
        "GroupNormalization",
        "RMSNormalization",
        "ReduceSumSquare",
        "ReduceL2",
        "Pow",
    }
)
MEAN_OPS = frozenset({"ReduceMean", "GlobalAveragePool"})
# Recurrent ops compute their gates with matrix products (CANN's DynamicRNN / DynamicGRUV2 run them on
# the Cube): counted with the Cube ops' MACs; gates per op.
RECURRENT_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
MAC_OPS = CUBE_OPS | frozenset(RECURRENT_GATES)
_MAG = "__calib_mag__"
_SHAPE = "__calib_shape__"


@dataclass
class Observed:
    """What the calibration pass read from one run of the graph."""

    outputs: dict[str, np.ndarray]  # the graph's own outputs, in fp32
    magnitude: dict[str, float]  # float tensor -> its largest |value|
    shapes: dict[str, list[int]] = field(default_factory=dict)  # tensors of Cube and mean nodes -> shape
    macs: dict[str, int] = field(default_factory=dict)  # Cube node -> its multiply-accumulates
    seconds: float = 0.0


def calibrate(
    prepared: PreparedGraph, feeds: Mapping[str, np.ndarray], sample: str
) -> tuple[GraphCalibration, Observed]:
    """One fp32 pass of `prepared` on `feeds`: the calibration record and what the pass read."""
    observed = observe(prepared, feeds)
    keep = [
        *_activation_rules(prepared, observed),
        *_weight_rules(prepared),
    ]
    unique = list({k.node: k for k in keep}.values())  # one reason per node: the first rule that kept it
    activations = [v for t, v in observed.magnitude.items() if t in prepared.producers]
    return (
        GraphCalibration(
            sample=sample,
            tensors=len(observed.magnitude),
            largest=max(activations, default=0.0),
            keep=unique,
            seconds=round(observed.seconds, 3),
        ),
        observed,
    )


def observe(prepared: PreparedGraph, feeds: Mapping[str, np.ndarray]) -> Observed:
    """The graph in fp32 with two more outputs per float tensor (its largest and smallest value,
    reduced inside the graph: no copy of the tensor) and the shapes of the tensors Cube and mean
    nodes read and write. Attention is computed a few heads at a time (`split_attention_heads`):
    a score matrix read by the reductions can no longer be fused away, and whole it is gigabytes."""
    model = onnx.ModelProto()
    model.CopyFrom(prepared.model)  # weights are external (prepared_light): a copy of the graph alone
    split_attention_heads(model)
    floats = _float_tensors(prepared, model)
    nodes: list[NodeProto] = []
    outputs = list(model.graph.output)
    watched: dict[str, str] = {}
    for tensor in [*(i.name for i in model.graph.input), *(o for n in model.graph.node for o in n.output)]:
        if tensor in floats and tensor not in watched:
            watched[tensor] = _magnitude(nodes, tensor, len(watched))
    shaped = _shaped_tensors(model)
    for k, tensor in enumerate(shaped):
        nodes.append(helper.make_node("Shape", [tensor], [f"{_SHAPE}{k}"], name=f"{_SHAPE}{k}"))
    outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, []) for name in watched.values()]
    outputs += [helper.make_tensor_value_info(f"{_SHAPE}{k}", TensorProto.INT64, [None]) for k in range(len(shaped))]
    graph = helper.make_graph(
        [*model.graph.node, *nodes], model.graph.name, list(model.graph.input), outputs, list(model.graph.initializer)
    )
    calibration = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    calibration.functions.extend(model.functions)
    started = time.perf_counter()
    values = run_beside(prepared.path, calibration, feeds)
    seconds = time.perf_counter() - started
    magnitude: dict[str, float] = {}
    for tensor, name in watched.items():
        origin = _original_tensor(tensor)
        magnitude[origin] = max(magnitude.get(origin, 0.0), max(0.0, float(values[name])))
    shapes = {tensor: [int(d) for d in values[f"{_SHAPE}{k}"]] for k, tensor in enumerate(shaped)}
    return Observed(
        outputs={o.name: values[o.name] for o in prepared.graph.output},
        magnitude=magnitude,
        shapes={_original_tensor(t): shape for t, shape in shapes.items()},
        macs=cube_macs(model, shapes),
        seconds=seconds,
    )


def _float_tensors(prepared: PreparedGraph, model: onnx.ModelProto) -> set[str]:
    """The float tensors of the (split) graph: the original's, and the slices' copies of them."""
    floats = set(prepared.float_tensors)
    for node in model.graph.node:
        if sliced_from(node.name) is not None or node.op_type == "Split":
            floats.update(o for o in node.output if _original_tensor(o) in prepared.float_tensors)
    return floats


_SLICE_SUFFIX = re.compile(r"__attention_heads_\d+_\d+$")  # `attention_heads._sliced` names


def _original_tensor(tensor: str) -> str:
    """A slice's copy of a tensor -> the tensor it is part of."""
    return _SLICE_SUFFIX.sub("", tensor)


def _magnitude(nodes: list[NodeProto], tensor: str, k: int) -> str:
    """The largest finite |value| of `tensor`, from its max and min (no copy of the tensor); only
    when one of them is infinite (an attention mask's -inf, which fp16 holds as well) does an `If`
    mask the infinities out, at the cost of a copy."""
    name = f"{_MAG}{k}"
    high, low, neg, out, bad = (f"{name}_{s}" for s in ("hi", "lo", "neg", "max", "inf"))
    nodes += [
        helper.make_node("ReduceMax", [tensor], [high], name=high, keepdims=0),
        helper.make_node("ReduceMin", [tensor], [low], name=low, keepdims=0),
        helper.make_node("Neg", [low], [neg], name=neg),
        helper.make_node("Max", [high, neg], [f"{out}_raw"], name=f"{out}_raw"),
        helper.make_node("IsInf", [f"{out}_raw"], [bad], name=bad),
    ]
    plain = helper.make_graph(
        [helper.make_node("Identity", [f"{out}_raw"], [f"{out}_plain"], name=f"{out}_plain")],
        f"{out}_plain_branch",
        [],
        [helper.make_tensor_value_info(f"{out}_plain", TensorProto.FLOAT, [])],
    )
    finite, zero, masked = f"{out}_finite", f"{out}_zero", f"{out}_masked"
    masked_branch = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], [zero], name=zero, value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])
            ),
            helper.make_node("IsInf", [tensor], [f"{finite}_inf"], name=f"{finite}_inf"),
            helper.make_node("Where", [f"{finite}_inf", zero, tensor], [finite], name=finite),
            helper.make_node("Abs", [finite], [f"{masked}_abs"], name=f"{masked}_abs"),
            helper.make_node("ReduceMax", [f"{masked}_abs"], [masked], name=masked, keepdims=0),
        ],
        f"{out}_masked_branch",
        [],
        [helper.make_tensor_value_info(masked, TensorProto.FLOAT, [])],
    )
    nodes.append(helper.make_node("If", [bad], [out], name=out, then_branch=masked_branch, else_branch=plain))
    return out


def _shaped_tensors(model: onnx.ModelProto) -> list[str]:
    """The tensors whose shapes count Cube MACs and mean depths (weights' shapes are known)."""
    weights = {t.name for t in model.graph.initializer}
    wanted: list[str] = []
    for node in model.graph.node:
        if node.op_type in MAC_OPS or node.op_type in MEAN_OPS:
            wanted += [t for t in [*node.input[:2], node.output[0]] if t and t not in weights]
    return list(dict.fromkeys(wanted))


def _activation_rules(prepared: PreparedGraph, observed: Observed) -> list[CalibrationKeep]:
    kept = []
    for node in prepared.graph.node:
        out = max((observed.magnitude.get(o, 0.0) for o in node.output), default=0.0)
        read = max((observed.magnitude.get(i, 0.0) for i in node.input if i), default=0.0)

        rule = _activation_rule(node, out, read, observed.shapes)
        if rule is not None:
            kept.append(
                CalibrationKeep(node=node.name, op_type=node.op_type, rule=rule[0], figure=rule[1], limit=rule[2])
            )
    return kept


def _activation_rule(
    node: NodeProto, out: float, read: float, shapes: Mapping[str, list[int]]
) -> tuple[str, float, float] | None:
    """The first rule a node's largest output (`out`) and input (`read`) magnitudes break, with its figure and limit."""
    if max(out, read) >= FP16_MAX:  # a tensor beyond fp16 overflows where it is written and where it is read
        return "overflow", max(out, read), FP16_MAX
    if out >= HEADROOM:
        return "headroom", out, HEADROOM
    if node.op_type in SQUARING_OPS and read >= SQUARE_LIMIT:
        return "squares", read, SQUARE_LIMIT
    if node.op_type in MEAN_OPS and (depth := _mean_depth(node, shapes)) and out * depth >= FP16_MAX:
        return "mean_of_large_sum", out * depth, FP16_MAX
    return None


def _mean_depth(node: NodeProto, shapes: Mapping[str, list[int]]) -> int:
    source, result = shapes.get(node.input[0]), shapes.get(node.output[0])
    if not source or result is None:
        return 0
    return int(np.prod(source)) // max(1, int(np.prod(result)))


def _weight_rules(prepared: PreparedGraph) -> list[CalibrationKeep]:
    """Consumers of weights beyond fp16's range and of small constants fp16 flushes to zero."""
    consumers: dict[str, list[NodeProto]] = {}
    for node in prepared.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    kept = []
    constants = [
        *(t for t in prepared.graph.initializer if t.data_type == TensorProto.FLOAT),
        *(_constant_value(n) for n in prepared.graph.node if n.op_type == "Constant"),
    ]
    for tensor in constants:
        if tensor is None or tensor.name not in consumers:
            continue
        values = _read(prepared, tensor)
        if values is None or not values.size:
            continue
        magnitudes = np.abs(values[np.isfinite(values)])
        largest = float(magnitudes.max(initial=0.0))
        nonzero = magnitudes[magnitudes > 0]
        rule: tuple[Any, float, float] | None = None
        if largest > FP16_MAX:
            rule = ("weight_range", largest, FP16_MAX)
        elif nonzero.size and values.nbytes <= EXTERNAL_TENSOR_MIN_BYTES and float(nonzero.max()) < UNDERFLOW:
            rule = ("constant_underflow", float(nonzero.max()), UNDERFLOW)
        if rule is not None:
            kept += [
                CalibrationKeep(node=c.name, op_type=c.op_type, rule=rule[0], figure=rule[1], limit=rule[2])
                for c in consumers[tensor.name]
            ]
    return kept


def _constant_value(node: NodeProto) -> TensorProto | None:
    for attribute in node.attribute:
        if attribute.name == "value" and attribute.t.data_type == TensorProto.FLOAT:
            tensor = TensorProto()
            tensor.CopyFrom(attribute.t)
            tensor.name = node.output[0]
            return tensor
    return None


def _read(prepared: PreparedGraph, tensor: TensorProto) -> np.ndarray | None:
    """A weight's values, one at a time (a 2 GB backbone is read tensor by tensor, never whole)."""
    try:
        return numpy_helper.to_array(tensor, base_dir=str(prepared.path.parent)).astype(np.float32, copy=False)
    except Exception:  # noqa: BLE001 - an unreadable weight is left to the emulation, which reads it anyway
        return None


def cube_macs(model: onnx.ModelProto, shapes: Mapping[str, list[int]]) -> dict[str, int]:
    """Cube node -> its multiply-accumulates on the recorded call; the slices of a node split by
    heads count under the node's own name."""
    known = {**{t.name: list(t.dims) for t in model.graph.initializer}, **shapes}
    macs: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in MAC_OPS and (count := _node_macs(node, known)) is not None:
            origin = sliced_from(node.name) or node.name
            macs[origin] = macs.get(origin, 0) + count
    return macs


def _node_macs(node: NodeProto, shapes: Mapping[str, list[int]]) -> int | None:
    ins = [shapes.get(i) for i in node.input]
    out = shapes.get(node.output[0])
    a, b = (ins + [None, None])[:2]
    if node.op_type == "MatMul" and a and out is not None:
        return int(np.prod(out, dtype=np.int64)) * a[-1]
    if node.op_type == "Gemm" and a and out is not None:
        trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
        return int(np.prod(out, dtype=np.int64)) * (a[0] if trans_a else a[-1])
    if node.op_type == "Conv" and b and out is not None:
        return int(np.prod(out, dtype=np.int64)) * int(np.prod(b[1:], dtype=np.int64))
    if node.op_type == "ConvTranspose" and a and b:
        return int(np.prod(a, dtype=np.int64)) * int(np.prod(b[1:], dtype=np.int64))
    if node.op_type == "Einsum" and all(ins):
        return _einsum_macs(node, [s for s in ins if s is not None])
    if node.op_type in RECURRENT_GATES and a and b and len(a) == 3 and len(b) == 3:
        # X [seq, batch, input] (or batch first), W [directions, gates x hidden, input]: per step and
        # direction, the gates' products with the input and with the hidden state.
        directions, gates_hidden, inputs = b
        hidden = gates_hidden // RECURRENT_GATES[node.op_type]
        return a[0] * a[1] * directions * gates_hidden * (inputs + hidden)
    return None


def _einsum_macs(node: NodeProto, shapes: list[list[int]]) -> int | None:
    equation = next((x.s.decode() for x in node.attribute if x.name == "equation"), "")
    terms = equation.replace(" ", "").split("->")[0].split(",")
    if "." in equation or len(terms) != len(shapes):
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        if len(term) != len(shape):
            return None
        sizes.update(zip(term, shape))
    return int(np.prod(list(sizes.values()), dtype=np.int64))


def fp16_macs(macs: Mapping[str, int], precisions: Mapping[str, str]) -> int:
    """The MACs of the Cube nodes a mode (with its keep list) runs with fp16 inputs."""
    return sum(count for node, count in macs.items() if precisions.get(node, "fp32") != "fp32")
