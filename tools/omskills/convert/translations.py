"""ONNX translations of aten ops that the dynamo exporter uses instead of onnxscript's torchlib.

Each entry replaces torchlib's translation for one reason that a probe measured; the graph
computes the same function with ops ATC supports (opset <= 18).

- `aten.group_norm` (and `aten.native_group_norm`): torchlib reshapes to (N, groups, -1) and calls
  InstanceNormalization. ONNX Runtime's CPU InstanceNormalization loses precision on large
  groups (a pixel decoder's 288x288x32 values per group; 5.6e-5 off after the first
  norm, 2.8e-4 after the second, where onnx's reference evaluator and torch agree to 2e-6).
  The two-pass form below (mean, then the mean of squared deviations) is what torch computes
  and is exact to fp32 rounding in ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from onnxscript import FLOAT, INT64
from onnxscript import opset18 as op


def _two_pass(input, weight, bias, group: int, eps: float):
    """(out, mean, rstd) of a group norm: the mean, then the mean of squared deviations."""
    # (N, group, rows, last dim): each mean is taken over the last dim, then over the rows, so
    # no single fp32 sum runs over a whole group (ORT's ReduceMean adds sequentially).
    batch = op.Shape(input, start=0, end=1)
    last = op.Shape(input, start=-1) if len(input.shape) >= 3 else op.Constant(value_ints=[1])
    grouped = op.Reshape(input, op.Concat(batch, op.Constant(value_ints=[group, -1]), last, axis=0))
    rows, cols = op.Constant(value_ints=[2]), op.Constant(value_ints=[3])
    mean = op.ReduceMean(op.ReduceMean(grouped, cols), rows)  # (N, group, 1, 1)
    centred = op.Sub(grouped, mean)
    variance = op.ReduceMean(op.ReduceMean(op.Mul(centred, centred), cols), rows)
    rstd = op.Reciprocal(op.Sqrt(op.Add(variance, op.CastLike(eps, input))))
    out = op.Reshape(op.Mul(centred, rstd), op.Shape(input))
    # weight and bias are per channel: (C,) -> (C, 1, ..., 1) against (N, C, *spatial).
    channel_axes = op.Constant(value_ints=list(range(1, len(input.shape) - 1)))
    if weight is not None:
        out = op.Mul(out, op.Unsqueeze(weight, channel_axes))
    if bias is not None:
        out = op.Add(out, op.Unsqueeze(bias, channel_axes))
    stats = op.Constant(value_ints=[2, 3])
    return out, op.Squeeze(mean, stats), op.Squeeze(rstd, stats)


def two_pass_group_norm(
    input: FLOAT,
    num_groups: int,
    weight: FLOAT | None = None,
    bias: FLOAT | None = None,
    eps: float = 1e-05,
    cudnn_enabled: bool = True,
) -> FLOAT:
    """group_norm(input, num_groups, weight?, bias?, eps, cudnn_enabled) -> out."""
    return _two_pass(input, weight, bias, num_groups, eps)[0]


def two_pass_native_group_norm(
    input: FLOAT,
    weight: FLOAT | None = None,
    bias: FLOAT | None = None,
    N: INT64 | None = None,
    C: INT64 | None = None,
    HxW: INT64 | None = None,
    group: int = 1,
    eps: float = 1e-05,
) -> tuple[FLOAT, FLOAT, FLOAT]:
    """native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd)."""
    return _two_pass(input, weight, bias, group, eps)


def translation_table() -> dict[torch._ops.OpOverload, Callable]:
    """The replacements, for torch.onnx.export(custom_translation_table=...)."""
    return {
        torch.ops.aten.group_norm.default: two_pass_group_norm,
        torch.ops.aten.native_group_norm.default: two_pass_native_group_norm,
    }


def translated_ops() -> list[str]:
    """Names of the aten ops translated here, for the export record."""
    return [str(target) for target in translation_table()]
