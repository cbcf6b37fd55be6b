"""Calibration: the largest magnitude of every float tensor of a graph on a recorded call, and the
nodes whose values leave fp16's useful range kept at their original dtype (as NVIDIA ModelOpt's
AutoCast does from one reference run), before any keep list is searched.

The magnitudes are read in the graph's first emulated pass, the one the fastest mode needs anyway:
each node's output before its fp16 rounding, which is the value the node computes from its (rounded)
inputs in fp32 arithmetic, within fp16's relative step of the fp32 graph's. Two reductions per
tensor (its max and min: no copy of it) are all the pass adds. Downstream of an overflow the values
are not the fp32 graph's: those nodes are judged in the next pass, after the overflowing node is
kept (`ascend.precision_fix` makes up to CALIBRATION_PASSES). The emulation rounds every fp16 node's
inputs and outputs and computes in fp32 between them, so an output beyond fp16's range shows there
too; what it cannot see is the arithmetic inside an operator, and inputs larger than the one
recorded. The rules, each with its limit:

- overflow: a node's output or input reaches ROUNDS_TO_INF (65520, which fp16 rounds to inf): it
  becomes inf where it is written in fp16, and where an fp16 node reads it (ATC casts a kept node's
  fp32 output to fp16 for its fp16 consumers), so the node and its readers are kept. A magnitude
  fp16 saturates at its largest finite value, 65504 (a -inf mask constant ATC clipped, and sums
  with it), is no range problem and judged by no rule.
- headroom: a node's output reaches HEADROOM (16384, a quarter of fp16's range): two doublings
  from overflow, the margin left for inputs larger than the recorded one (ModelOpt's default is
  512 for GPU kernels that may compute in fp16 throughout; Ascend's Cube accumulates in fp32).
- squares: an operator that squares its input inside (normalisations, ReduceSumSquare, ReduceL2,
  Pow) reads a magnitude of SQUARE_LIMIT (256) or more: 256^2 = 65536 is beyond fp16.
- mean_of_large_sum: a mean (ReduceMean, GlobalAveragePool) whose output magnitude times its
  depth (the elements it averages) reaches FP16_MAX: a sum accumulated in fp16 would overflow
  before the division.
- weight_range: a weight beyond FP16_MAX, which ATC clips to +-65504 before casting them
  (`--is_weight_clip`, its default): the value changes silently; its consumers are kept.
- constant_underflow: a small constant every non-zero value of which rounds to 0 in fp16 (below
  2^-25, half of fp16's smallest subnormal), such as an epsilon of 1e-12: its consumers are kept.

The same pass counts the graph's Cube multiply-accumulates (`cube_macs`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from omskills.ascend.attention_heads import sliced_from
from omskills.ascend.emulation import EmulatedRun, PreparedGraph, observe_emulated
from omskills.ascend.precision_modes import CUBE_OPS, FP16_MAX
from omskills.onnxfiles.onnx_io import EXTERNAL_TENSOR_MIN_BYTES
from omskills.records.precision import CalibrationKeep, GraphCalibration
from onnx import NodeProto, TensorProto, numpy_helper

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
# fp16 rounds a magnitude of 65520 or more to inf; one in [65488, 65520) to 65504, its largest finite
# value. An attention mask's -inf constant, clipped by ATC to -65504 (`--is_weight_clip`), and the
# sums made with it land there: saturated values fp16 holds, which no rule judges.
ROUNDS_TO_INF = 65520.0
SATURATED_FROM = 65488.0
# Recurrent ops compute their gates with matrix products (CANN's DynamicRNN / DynamicGRUV2 run them on
# the Cube): counted with the Cube ops' MACs; gates per op.
RECURRENT_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
MAC_OPS = CUBE_OPS | frozenset(RECURRENT_GATES)


def calibrate(
    prepared: PreparedGraph,
    feeds: Mapping[str, np.ndarray],
    sample: str,
    precisions: Mapping[str, str],
    weights: list[CalibrationKeep] | None = None,
) -> tuple[GraphCalibration, EmulatedRun]:
    """One emulated pass of `prepared` in `precisions` on `feeds`, observed: the calibration record
    (the nodes its magnitudes and the weights put beyond fp16's range) and the run itself.
    `weights`: `weight_rules(prepared)` when already read (every weight is read: a second pass
    need not read a 2 GB backbone again)."""
    started = time.perf_counter()
    run = observe_emulated(prepared, precisions, feeds, shaped_tensors)
    keep = [*_activation_rules(prepared, run, feeds), *(weight_rules(prepared) if weights is None else weights)]
    unique = list({k.node: k for k in keep}.values())  # one reason per node: the first rule that kept it
    activations = [v for t, v in run.magnitude.items() if t in prepared.producers and math.isfinite(v)]
    calibration = GraphCalibration(
        sample=sample,
        tensors=len(run.magnitude),
        largest=max(activations, default=0.0),
        keep=unique,
        seconds=round(time.perf_counter() - started, 3),
    )
    return calibration, run


def shaped_tensors(model: onnx.ModelProto) -> list[str]:
    """The tensors whose shapes count Cube MACs and mean depths (weights' shapes are known)."""
    weights = {t.name for t in model.graph.initializer}
    wanted: list[str] = []
    for node in model.graph.node:
        if node.op_type in MAC_OPS or node.op_type in MEAN_OPS:
            wanted += [t for t in [*node.input[:2], node.output[0]] if t and t not in weights]
    return list(dict.fromkeys(wanted))


def _activation_rules(
    prepared: PreparedGraph, run: EmulatedRun, feeds: Mapping[str, np.ndarray]
) -> list[CalibrationKeep]:
    """Nodes whose observed magnitudes break a rule; a node that wrote or read an infinite value is
    downstream of an overflow (not the fp32 graph's values): left for the next pass."""
    magnitude = dict(run.magnitude)
    for name, value in feeds.items():
        array = np.asarray(value)
        if array.dtype.kind == "f" and array.size:
            finite = np.abs(array[np.isfinite(array)].astype(np.float64))
            magnitude[name] = float(finite.max(initial=0.0))
    kept = []
    for node in prepared.graph.node:
        out = max((magnitude.get(o, 0.0) for o in node.output), default=0.0)
        read = max((magnitude.get(i, 0.0) for i in node.input if i), default=0.0)
        if not (math.isfinite(out) and math.isfinite(read)):
            continue
        rule = _activation_rule(node, out, read, run.shapes)
        if rule is not None:
            kept.append(
                CalibrationKeep(node=node.name, op_type=node.op_type, rule=rule[0], figure=rule[1], limit=rule[2])
            )
    return kept


def _activation_rule(
    node: NodeProto, out: float, read: float, shapes: Mapping[str, list[int]]
) -> tuple[str, float, float] | None:
    """The first rule a node's largest output (`out`) and input (`read`) magnitudes break, with its figure and limit."""
    out, read = _unsaturated(out), _unsaturated(read)
    if max(out, read) >= ROUNDS_TO_INF:  # beyond fp16: inf where it is written and where it is read
        return "overflow", max(out, read), ROUNDS_TO_INF
    if out >= HEADROOM:
        return "headroom", out, HEADROOM
    if node.op_type in SQUARING_OPS and read >= SQUARE_LIMIT:
        return "squares", read, SQUARE_LIMIT
    if node.op_type in MEAN_OPS and (depth := _mean_depth(node, shapes)) and out * depth >= FP16_MAX:
        return "mean_of_large_sum", out * depth, FP16_MAX
    return None


def _unsaturated(value: float) -> float:
    """`value`, or 0 for a magnitude fp16 saturates at 65504 (a clipped mask; see SATURATED_FROM)."""
    return 0.0 if SATURATED_FROM <= value < ROUNDS_TO_INF else value


def _mean_depth(node: NodeProto, shapes: Mapping[str, list[int]]) -> int:
    source, result = shapes.get(node.input[0]), shapes.get(node.output[0])
    if not source or result is None:
        return 0
    return int(np.prod(source)) // max(1, int(np.prod(result)))


def weight_rules(prepared: PreparedGraph) -> list[CalibrationKeep]:
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
