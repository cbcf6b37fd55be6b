"""How each node of an ONNX graph computes under one of ATC's `--precision_mode` values.

From CANN's ATC guide (`--precision_mode`, see skills/onnx-atc-pipeline/references/
precision-modes.md and precision-emulation.md): matrix (Cube) operators and vector operators
are treated apart. Cube operators compute fp16 x fp16 products accumulated in fp32; their
output is fp16 unless the mode asks for fp32 out. Vector operators run in the dtype the mode
gives them. `--keep_dtype` keeps named nodes at their original dtype.

The mixed mode's built-in lists live per operator in CANN's `aic-<soc>-ops-info.json`
(`precision_reduce`); they are not published as a table, so `MIX_FP32_OPS` is an
approximation stated as one: the reductions and transcendental ops that mixed precision
conventionally keeps in fp32. Other vector ops follow their inputs (gray list).
"""

from __future__ import annotations

from collections.abc import Iterable

from omskills.records.precision import NodePrecision
from onnx import GraphProto, NodeProto

# ONNX op types CANN runs on the Cube unit (convolutions and matrix products).
CUBE_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})
# Approximation of the mixed mode's fp32 ("black") list; see the module docstring.
MIX_FP32_OPS = frozenset(
    {
        "Exp",
        "Log",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "ReduceMean",
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceL2",
        "ReduceLogSumExp",
        "CumSum",
        "Erf",
    }
)
FP16_MAX = 65504.0  # the largest finite float16

# The modes emulated by default (the acceptance set and the ones users choose among), fastest first.
DEFAULT_MODES: tuple[str, ...] = ("force_fp16", "allow_mix_precision", "allow_fp32_to_fp16", "must_keep_origin_dtype")
# Fastest first: the mode chosen is the first whose emulated result passes (with its keep list).
SPEED_ORDER: tuple[str, ...] = (
    "force_fp16",
    "allow_mix_precision",
    "allow_mix_precision_fp16",
    "allow_fp32_to_fp16",
    "force_fp32",
    "cube_fp16in_fp32out",
    "must_keep_origin_dtype",
)
# The ATC precision mode of a graph whose modes were never emulated (its emulation failed or did not run).
UNCHECKED_PRECISION_MODE = "must_keep_origin_dtype"
MIXED_MODES = frozenset({"allow_mix_precision", "allow_mix_precision_fp16"})
EMULATED_MODES = frozenset(SPEED_ORDER)


def node_precisions(
    graph: GraphProto, float_tensors: set[str], mode: str, keep: Iterable[str] = ()
) -> dict[str, NodePrecision]:
    """node name -> how it computes under `mode`, for nodes with a float output; nodes named in
    `keep` (ATC's --keep_dtype) compute in fp32."""
    if mode not in EMULATED_MODES:
        raise ValueError(f"precision mode {mode!r} is not emulated; emulated: {sorted(EMULATED_MODES)}")
    keep = set(keep)
    produced_fp16: set[str] = set()
    result: dict[str, NodePrecision] = {}
    for node in graph.node:
        if not any(o in float_tensors for o in node.output):
            continue
        if node.name in keep:
            precision: NodePrecision = "fp32"
        else:
            precision = _mode_precision(node, mode, produced_fp16)
        result[node.name] = precision
        if precision == "fp16":
            produced_fp16.update(o for o in node.output if o in float_tensors)
    return result


def _mode_precision(node: NodeProto, mode: str, produced_fp16: set[str]) -> NodePrecision:
    cube = node.op_type in CUBE_OPS
    if mode == "force_fp16":
        return "fp16"
    if mode == "allow_fp32_to_fp16":
        return "fp16" if cube else "fp32"
    if mode in ("force_fp32", "cube_fp16in_fp32out"):
        return "fp16_in" if cube else "fp32"
    if mode in MIXED_MODES:
        if cube:
            return "fp16"
        if node.op_type in MIX_FP32_OPS:
            return "fp32"
        return "fp16" if any(i in produced_fp16 for i in node.input) else "fp32"
    return "fp32"  # must_keep_origin_dtype
