"""Ascend precision on ONNX Runtime CPU: the graph rewritten with fp16 roundings where a mode
makes Ascend compute in fp16, and a side-by-side graph that compares it with fp32 node by node.

Rounding is a Cast to float16 and back: values beyond fp16's range become inf as on the NPU,
and the arithmetic between two roundings stays fp32, which is what the Cube unit does (fp16
products accumulated in fp32). For vector operators it is an assumption: each operator's
inputs and outputs are fp16, its internal arithmetic is not (precision-emulation.md says what
this can and cannot show). Nothing here models ATC's own lowering of a graph.

The comparison graph holds two copies of every float node, the fp32 original and the emulated
one. Each compared tensor is reduced inside the graph to nine numbers (sums of squares of the
error and of both tensors, max abs error, max |reference|, inf and NaN counts of both), so
memory stays that of about two runs of the graph whatever its size. The first node over the
gate is then emulated alone on the fp32 inputs ("local") in a graph cut after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omskills.ascend.attention_heads import sliced_from, split_attention_heads
from omskills.ascend.precision_modes import FP16_MAX, node_precisions
from omskills.files import process_alive
from omskills.onnxfiles.detached_weights import move_inline_weights
from omskills.onnxfiles.onnx_io import EXTERNAL_TENSOR_MIN_BYTES, released
from omskills.records.precision import (
    EMULATED_BACKEND,
    LayerComparison,
    LayerFinding,
    NodeComparison,
    NodePrecision,
    PrecisionGates,
    TensorError,
)
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

MAX_FLAGGED_LISTED = 50
# Bumped when the emulation computes differently, so recorded results of an older one are redone.
EMULATION_REVISION = (
    6  # 4: calibration, keep-list search; 5: calibration read in the emulated passes; 6: a near miss is not searched
)

# Float inputs that say how an operator works rather than what it computes on (a Resize's region
# and scales): ATC leaves them as they are, and rounded they could change an output's size.
PARAMETER_INPUTS: dict[str, set[int]] = {"Resize": {1, 2}, "Upsample": {1}}
# Operators whose outputs are values of their float inputs (moved, selected, negated, or the larger
# of two): on inputs rounded to fp16 their outputs are fp16 values already, so rounding them again
# would change no bit and cost two full-size Casts. Nearly half a ViT backbone's nodes are these.
VALUE_PRESERVING_OPS = frozenset(
    {
        "Reshape",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Identity",
        "Slice",
        "Split",
        "Concat",
        "Gather",
        "GatherElements",
        "GatherND",
        "Expand",
        "Tile",
        "DepthToSpace",
        "SpaceToDepth",
        "Where",
        "Relu",
        "Neg",
        "Abs",
        "Max",
        "Min",
    }
)


@dataclass
class PreparedGraph:
    """A model read without its weights (they stay in the external-data file beside it), every
    node named, and which tensors are fp32."""

    path: Path
    model: ModelProto
    float_tensors: set[str]
    producers: dict[str, NodeProto] = field(default_factory=dict)
    elem_types: dict[str, int] = field(default_factory=dict)  # tensor -> TensorProto type, where known
    ranks: dict[str, int] = field(default_factory=dict)  # tensor -> rank, where shape inference knows it
    # Set by `prepared_light`: a scratch file beside the graph for weights rounded to fp16 here
    # (see `rounded_weight`); None where derived graphs must round their weights in-graph.
    rounded_weights_file: Path | None = None
    _rounded_weights: dict[str, TensorProto] = field(default_factory=dict)

    @property
    def graph(self) -> GraphProto:
        return self.model.graph

    @cached_property
    def node_named(self) -> dict[str, NodeProto]:
        return {n.name: n for n in self.model.graph.node}

    @cached_property
    def initializer_named(self) -> dict[str, TensorProto]:
        return {t.name: t for t in self.model.graph.initializer}

    def rounded_weight(self, name: str) -> TensorProto | None:
        """Weight `name` clipped to fp16's range and rounded to fp16 (as fp32 values), written
        once to `rounded_weights_file`; None without one. Rounded in the graph instead (Clip and
        two Casts), ONNX Runtime folds them when the session loads, holding the original and the
        rounded copy of every weight at once: for a 2 GB backbone, gigabytes more than the graph
        needs to run."""
        if self.rounded_weights_file is None:
            return None
        if name not in self._rounded_weights:
            original = self.initializer_named[name]
            values = numpy_helper.to_array(original, base_dir=str(self.path.parent))
            # ATC clips fp32 weights to fp16's range before casting them (--is_weight_clip=1, its
            # default): a weight beyond it becomes +-65504, not inf.
            rounded = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float32)
            tensor = TensorProto(name=f"{name}__fp16", data_type=TensorProto.FLOAT, dims=list(rounded.shape))
            if rounded.nbytes < EXTERNAL_TENSOR_MIN_BYTES:  # a small constant stays readable by shape inference
                tensor.raw_data = rounded.tobytes()
                self._rounded_weights[name] = tensor
                return tensor
            with open(self.rounded_weights_file, "ab") as handle:
                offset = handle.tell()
                handle.write(rounded.tobytes())
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (
                ("location", self.rounded_weights_file.name),
                ("offset", str(offset)),
                ("length", str(rounded.nbytes)),
            ):
                tensor.external_data.add(key=key, value=value)
            self._rounded_weights[name] = tensor
        return self._rounded_weights[name]


def prepare(path: str | Path, weights_to: Path | None = None) -> PreparedGraph:
    """`path` read without its external weights; with `weights_to`, the weights it holds inline
    are moved to that file too (see `prepared_light`)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    if weights_to is not None:
        move_inline_weights(model, weights_to)
        model = released(model)
    return _prepared(model, path)


def _prepared(model: ModelProto, path: Path) -> PreparedGraph:
    """`model` (read from `path`, whose folder holds its external weights) with every node named
    and its tensors typed."""
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a help, not a requirement: the declared types remain
        typed = model
    values = [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]
    elem_types = {v.name: v.type.tensor_type.elem_type for v in values if v.type.tensor_type.elem_type}
    elem_types.update({t.name: t.data_type for t in model.graph.initializer})
    float_tensors = {name for name, kind in elem_types.items() if kind == TensorProto.FLOAT}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}
    ranks.update({t.name: len(t.dims) for t in model.graph.initializer})
    producers = {o: n for n in model.graph.node for o in n.output}
    return PreparedGraph(
        path=path, model=model, float_tensors=float_tensors, producers=producers, elem_types=elem_types, ranks=ranks
    )


@contextmanager
def prepared_light(path: str | Path) -> Iterator[PreparedGraph]:
    """`prepare(path)` with the weights a .onnx holds inline (a graph under protobuf's 2 GB is
    saved that way) moved, while the block runs, to a hidden file beside it. Every graph the
    emulation derives from it (emulated, side by side, cut after a node) is then a few MB to
    copy, save and parse, instead of another copy of every weight in memory each time. Graphs
    saved to keep (`save_emulated`) need `prepare`: this file goes when the block ends."""
    path = Path(path)
    _remove_orphaned_weights(path)
    data = path.with_name(f".{path.name}.{os.getpid()}.weights")
    rounded = path.with_name(f".{path.name}.{os.getpid()}.fp16.weights")
    try:
        prepared = prepare(path, weights_to=data)
        prepared.rounded_weights_file = rounded
        yield prepared
    finally:
        data.unlink(missing_ok=True)
        rounded.unlink(missing_ok=True)


def _remove_orphaned_weights(path: Path) -> None:
    """The weight files of emulations whose process is gone (a child the OOM killer took)."""
    for stale in path.parent.glob(f".{path.name}.*.weights"):
        pid = stale.name[len(path.name) + 2 :].split(".")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            stale.unlink(missing_ok=True)


def precisions_for(prepared: PreparedGraph, mode: str, keep: Iterable[str] = ()) -> dict[str, NodePrecision]:
    return node_precisions(prepared.graph, prepared.float_tensors, mode, keep)


class _Rewriter:
    """Emits the nodes of one copy of the graph: tensor names mapped by `suffix` (graph inputs
    and initializers shared), fp16 roundings where the node's precision asks for them."""

    def __init__(
        self,
        prepared: PreparedGraph,
        nodes: list[NodeProto],
        suffix: str,
        count_overflow: bool = False,
        observe: bool = False,
    ) -> None:
        self.prepared, self.nodes, self.suffix = prepared, nodes, suffix
        # Counted right after each rounding, so the raw output can go at once: counted at the
        # end, every activation of the graph would stay alive until then.
        self.count_overflow = count_overflow
        self.overflow_counts: list[str] = []
        # With `observe`, each float output's largest finite magnitude as computed, before its fp16
        # rounding: an output `MAGNITUDE_PREFIX + tensor` (calibration reads them).
        self.observe = observe
        self.observed: list[str] = []
        self.shared = {i.name for i in prepared.graph.input} | {t.name for t in prepared.graph.initializer}
        self.weights = {t.name for t in prepared.graph.initializer}
        self.rounded: dict[str, str] = {}
        self.rounded_weights: dict[
            str, TensorProto
        ] = {}  # initializers this copy reads (`PreparedGraph.rounded_weight`)
        self._limits: tuple[str, str] | None = None
        self._last_axis: str | None = None
        self._outer: dict[str, str] | None = None

    def _fp16_limits(self) -> tuple[str, str]:
        if self._limits is None:
            low, high = f"__fp16_min{self.suffix}", f"__fp16_max{self.suffix}"
            for name, value in ((low, -FP16_MAX), (high, FP16_MAX)):
                self.nodes.append(
                    helper.make_node(
                        "Constant",
                        [],
                        [name],
                        name=f"{name}__const",
                        value=helper.make_tensor("v", TensorProto.FLOAT, [], [value]),
                    )
                )
            self._limits = (low, high)
        return self._limits

    def _rows(self) -> tuple[str, int]:
        """A constant [-1] (made once) and the graph's opset, for reductions by rows (`largest_magnitude`)."""
        name = f"__last_axis{self.suffix}"
        if self._last_axis is None:
            self.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [name],
                    name=f"{name}__const",
                    value=helper.make_tensor("v", TensorProto.INT64, [1], [-1]),
                )
            )
            self._last_axis = name
        return self._last_axis, _opset(self.prepared.model)

    def name(self, tensor: str) -> str:
        return tensor if not tensor or tensor in self.shared or not self.suffix else tensor + self.suffix

    def round(self, tensor: str) -> str:
        """A fp16-rounded copy of `tensor` (already mapped), made once."""
        if tensor not in self.rounded:
            half, back = f"{tensor}__to_fp16{self.suffix}", f"{tensor}__fp16{self.suffix}"
            source = tensor
            offline = self.prepared.rounded_weight(tensor) if tensor in self.weights else None
            if offline is not None:
                self.rounded_weights[offline.name] = offline
                self.rounded[tensor] = offline.name
                return offline.name
            if tensor in self.weights:
                # ATC clips fp32 weights to fp16's range before casting them (--is_weight_clip=1,
                # its default): a weight beyond it becomes +-65504, not inf.
                source = f"{tensor}__clipped{self.suffix}"
                self.nodes.append(
                    helper.make_node("Clip", [tensor, *self._fp16_limits()], [source], name=f"{source}__clip")
                )
            self.nodes.append(helper.make_node("Cast", [source], [half], to=TensorProto.FLOAT16, name=f"{half}__cast"))
            self.nodes.append(helper.make_node("Cast", [half], [back], to=TensorProto.FLOAT, name=f"{back}__cast"))
            self.rounded[tensor] = back
        return self.rounded[tensor]

    def emit(self, node: NodeProto, precision: NodePrecision, inputs: list[str], tag: str) -> list[str]:
        """Append a copy of `node` reading `inputs` (mapped names); returns its output names."""
        floats = self.prepared.float_tensors
        if precision != "fp32":
            parameters = PARAMETER_INPUTS.get(node.op_type, set())
            inputs = [
                self.round(mapped) if original in floats and mapped and k not in parameters else mapped
                for k, (original, mapped) in enumerate(zip(node.input, inputs))
            ]
        outputs = [self.name(o) + tag if o else "" for o in node.output]
        rounds = precision == "fp16" and not self._preserves_rounded_values(node)
        raw = [f"{o}__raw" if rounds and orig in floats else o for o, orig in zip(outputs, node.output)]
        if precision == "fp16" and not rounds:  # its float inputs were rounded above: so are its outputs
            self.rounded.update((o, o) for o, orig in zip(outputs, node.output) if orig in floats)
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = node.name + (self.suffix + tag if self.suffix or tag else "")
        del copy.input[:], copy.output[:]
        copy.input.extend(inputs)
        copy.output.extend(raw)
        if self.suffix and has_subgraph(node):
            _rename_outer_references(copy, self._mapping_for_subgraphs())
        self.nodes.append(copy)
        magnitudes: dict[str, str] = {}  # raw output -> its largest |value|, infinities included
        if self.observe:
            for produced, original in zip(raw, node.output):
                if original in floats:
                    rows = self._rows() if self.prepared.ranks.get(original, 0) >= 2 else None
                    self.observed.append(largest_magnitude(self.nodes, produced, f"{MAGNITUDE_PREFIX}{original}", rows))
                    magnitudes[produced] = f"{self.observed[-1]}__raw"
        for produced, final in zip(raw, outputs):
            if produced != final:
                checks = (
                    _OverflowChecks(
                        self.nodes, produced, final, limit=self._fp16_limits()[1], largest=magnitudes.get(produced)
                    )
                    if self.count_overflow
                    else None
                )
                half = f"{final}__to_fp16"
                self.nodes.append(
                    helper.make_node("Cast", [produced], [half], to=TensorProto.FLOAT16, name=f"{half}__cast")
                )
                self.nodes.append(
                    helper.make_node("Cast", [half], [final], to=TensorProto.FLOAT, name=f"{final}__cast")
                )
                self.rounded[final] = final  # already fp16-valued: consumers need not round it again
                if checks is not None:
                    self.overflow_counts.append(checks.new_infinities())
        return outputs

    def _preserves_rounded_values(self, node: NodeProto) -> bool:
        """A VALUE_PRESERVING_OPS node every input of which has a known type: its float inputs were
        rounded (an input of unknown type might be a float that was not)."""
        known = self.prepared.elem_types
        return node.op_type in VALUE_PRESERVING_OPS and all(not i or i in known for i in node.input)

    def _mapping_for_subgraphs(self) -> dict[str, str]:
        """Every tensor the graph produces -> its name in this copy (made once, on the first subgraph)."""
        if self._outer is None:
            self._outer = {o: self.name(o) for o in self.prepared.producers}
        return self._outer


def _rename_outer_references(node: NodeProto, mapping: Mapping[str, str]) -> None:
    """Subgraph bodies (If/Loop/Scan) read outer tensors by name: point them at this copy's."""
    for attribute in node.attribute:
        bodies = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for body in bodies:
            local = {o for n in body.node for o in n.output} | {i.name for i in body.input}
            for inner in body.node:
                for k, name in enumerate(inner.input):
                    if name and name not in local and name in mapping:
                        inner.input[k] = mapping[name]
                _rename_outer_references(inner, mapping)


OVERFLOW_OUTPUT = "__fp16_overflow"
MAGNITUDE_PREFIX = "__magnitude__"
SHAPE_PREFIX = "__shape__"


def largest_magnitude(nodes: list[NodeProto], tensor: str, out: str, rows: tuple[str, int] | None = None) -> str:
    """Nodes appended to `nodes` that reduce `tensor` to its largest finite |value|, named `out`:
    from its max and min (no copy of the tensor); only when one of them is infinite (an attention
    mask's -inf, which fp16 holds as well) does an `If` mask the infinities out, at a copy's cost.
    `out + "__raw"` holds the largest |value| infinities included (the overflow count reads it).
    `rows`: for a tensor of rank 2 or more, the name of a constant [-1] and the graph's opset: each
    row's max and min first, then theirs (ONNX Runtime reduces a whole tensor on one thread, rows on
    every thread: half the time on two cores)."""
    high, low, neg, raw, bad = (f"{out}__{s}" for s in ("hi", "lo", "neg", "raw", "inf"))
    nodes += [
        *_reduced("ReduceMax", tensor, high, rows),
        *_reduced("ReduceMin", tensor, low, rows),
        helper.make_node("Neg", [low], [neg], name=neg),
        helper.make_node("Max", [high, neg], [raw], name=raw),
        helper.make_node("IsInf", [raw], [bad], name=bad),
    ]
    plain = helper.make_graph(
        [helper.make_node("Identity", [raw], [f"{out}__plain"], name=f"{out}__plain")],
        f"{out}__plain_branch",
        [],
        [helper.make_tensor_value_info(f"{out}__plain", TensorProto.FLOAT, [])],
    )
    zero, finite, absolute, masked = (f"{out}__{s}" for s in ("zero", "finite", "abs", "masked"))
    masked_branch = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], [zero], name=zero, value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])
            ),
            helper.make_node("IsInf", [tensor], [f"{finite}__inf"], name=f"{finite}__inf"),
            helper.make_node("Where", [f"{finite}__inf", zero, tensor], [finite], name=finite),
            helper.make_node("Abs", [finite], [absolute], name=absolute),
            helper.make_node("ReduceMax", [absolute], [masked], name=masked, keepdims=0),
        ],
        f"{out}__masked_branch",
        [],
        [helper.make_tensor_value_info(masked, TensorProto.FLOAT, [])],
    )
    nodes.append(helper.make_node("If", [bad], [out], name=out, then_branch=masked_branch, else_branch=plain))
    return out


def _reduced(op: str, tensor: str, out: str, rows: tuple[str, int] | None) -> list[NodeProto]:
    """`op` over every element of `tensor`, named `out`; with `rows` (see `largest_magnitude`) in two steps."""
    if rows is None:
        return [helper.make_node(op, [tensor], [out], name=out, keepdims=0)]
    last_axis, opset = rows
    per_row = f"{out}__rows"
    first = (
        helper.make_node(op, [tensor, last_axis], [per_row], name=per_row, keepdims=0)
        if opset >= 18
        else helper.make_node(op, [tensor], [per_row], name=per_row, keepdims=0, axes=[-1])
    )
    return [first, helper.make_node(op, [per_row], [out], name=out, keepdims=0)]


def emulated_model(
    prepared: PreparedGraph,
    precisions: Mapping[str, NodePrecision],
    count_overflow: bool = False,
    observe: Iterable[str] | None = None,
) -> ModelProto:
    """The graph as the mode computes it, with the original input and output names; with
    `count_overflow`, one more output: how many elements fp16 rounding turned into inf; with
    `observe` (tensors whose shapes to read), the largest magnitude of every float output before
    its rounding (`MAGNITUDE_PREFIX` + tensor) and those tensors' shapes (`SHAPE_PREFIX` + tensor).
    Large attention is split by heads beforehand, on the fp32 graph (`split_by_heads`): found on
    this one, it costs a shape inference of a graph ten times larger (40 s for a decoder)."""
    nodes: list[NodeProto] = []
    writer = _Rewriter(prepared, nodes, suffix="", count_overflow=count_overflow, observe=observe is not None)
    for node in prepared.graph.node:
        writer.emit(node, precisions.get(node.name, "fp32"), list(node.input), tag="")
    outputs = list(prepared.graph.output)
    if observe is not None:
        outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, []) for name in writer.observed]
        for tensor in observe:
            nodes.append(
                helper.make_node("Shape", [tensor], [f"{SHAPE_PREFIX}{tensor}"], name=f"{SHAPE_PREFIX}{tensor}")
            )
            outputs.append(helper.make_tensor_value_info(f"{SHAPE_PREFIX}{tensor}", TensorProto.INT64, [None]))
    if count_overflow:
        counts = writer.overflow_counts
        zero = helper.make_node(
            "Constant",
            [],
            [f"{OVERFLOW_OUTPUT}__0"],
            name=f"{OVERFLOW_OUTPUT}__zero",
            value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0]),
        )
        nodes.append(zero)
        nodes.append(
            helper.make_node("Sum", [zero.output[0], *counts], [OVERFLOW_OUTPUT], name=f"{OVERFLOW_OUTPUT}__sum")
        )
        outputs.append(helper.make_tensor_value_info(OVERFLOW_OUTPUT, TensorProto.FLOAT, []))
    return _derived(prepared, nodes, outputs, writer)


class _OverflowChecks:
    """How many elements of `raw` the fp16 rounding turns into inf, counted in nodes written
    before and after the rounding's two Casts.

    Counting needs full-size masks (and a float copy to sum them), several times the tensor
    itself: on a full-scale attention score matrix that is gigabytes. So the graph first reads
    the largest magnitude (ReduceMax and ReduceMin make no full-size copy) and only when it
    reaches fp16's range does an `If` build the masks. Infinities are counted before the rounding
    (on `raw`, which can then go at once) and after it (on the rounded copy); rounding keeps every
    inf and makes no NaN an inf, so their difference is the count of new ones."""

    def __init__(self, nodes: list[NodeProto], raw: str, rounded: str, limit: str, largest: str | None = None) -> None:
        """`largest`: the largest |value| of `raw` (infinities included) when the graph already reads it."""
        self.nodes, self.rounded, self.name = nodes, rounded, f"{rounded}__overflow"
        if largest is None:
            high = self._add("ReduceMax", [raw], "max", keepdims=0)
            low = self._add("Neg", [self._add("ReduceMin", [raw], "min", keepdims=0)], "neg_min")
            largest = self._add("Max", [high, low], "largest")
        # Not(largest < limit) rather than (largest >= limit): a NaN maximum takes the exact branch too.
        self.reaches = self._add("Not", [self._add("Less", [largest, limit], "below")], "reaches")
        self.raw_infinities = self._infinities_if_reaching(raw, "raw_inf")

    def new_infinities(self) -> str:
        return self._add("Sub", [self._infinities_if_reaching(self.rounded, "inf"), self.raw_infinities], "new")

    def _add(self, op: str, inputs: list[str], suffix: str, **attrs) -> str:
        out = f"{self.name}__{suffix}"
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def _infinities_if_reaching(self, tensor: str, suffix: str) -> str:
        """The count of infinite elements of `tensor` (float), or 0 without counting when the
        magnitude stays below fp16's range."""
        out = f"{self.name}__{suffix}"
        is_inf, as_float, count = f"{out}__is_inf", f"{out}__f", f"{out}__count"
        counted = helper.make_graph(
            [
                helper.make_node("IsInf", [tensor], [is_inf], name=is_inf),
                helper.make_node("Cast", [is_inf], [as_float], to=TensorProto.FLOAT, name=as_float),
                helper.make_node("ReduceSum", [as_float], [count], keepdims=0, name=count),
            ],
            f"{out}__counted",
            [],
            [helper.make_tensor_value_info(count, TensorProto.FLOAT, [])],
        )
        zero = f"{out}__zero"
        skipped = helper.make_graph(
            [
                helper.make_node(
                    "Constant", [], [zero], name=zero, value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])
                )
            ],
            f"{out}__skipped",
            [],
            [helper.make_tensor_value_info(zero, TensorProto.FLOAT, [])],
        )
        self.nodes.append(
            helper.make_node("If", [self.reaches], [out], name=out, then_branch=counted, else_branch=skipped)
        )
        return out


def run_emulated_with_overflow(
    prepared: PreparedGraph, precisions: Mapping[str, NodePrecision], feeds: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], int]:
    """The emulated graph's outputs and its fp16 overflow count, in one run. Attention is split by
    heads first (`split_by_heads`): the counts read every rounded tensor, so split afterwards a
    region would stay whole, each score tensor alive with its copies (gigabytes at full scale)."""
    run = observe_emulated(prepared, precisions, feeds, None)
    return run.outputs, run.overflow


@dataclass
class EmulatedRun:
    """One emulated run: the graph's outputs, its overflow count and, when asked, what it observed."""

    outputs: dict[str, np.ndarray]
    overflow: int
    magnitude: dict[str, float] = field(default_factory=dict)  # float tensor -> largest finite |value|
    shapes: dict[str, list[int]] = field(default_factory=dict)
    model: ModelProto | None = None  # the graph that ran (split by heads): its nodes, for counting MACs


def observe_emulated(
    prepared: PreparedGraph,
    precisions: Mapping[str, NodePrecision],
    feeds: Mapping[str, np.ndarray],
    shaped: Callable[[ModelProto], list[str]] | None,
) -> EmulatedRun:
    """The emulated graph run once; with `shaped` (the tensors whose shapes to read, chosen on the
    graph as it runs), the largest magnitude of every float output before its rounding too,
    slices of a tensor split by heads folded into the tensor."""
    prepared, precisions = split_by_heads(prepared, precisions) or (prepared, precisions)
    observe = shaped(prepared.model) if shaped is not None else None
    model = emulated_model(prepared, precisions, count_overflow=True, observe=observe)
    values = run_beside(prepared.path, model, feeds)
    run = EmulatedRun(
        outputs={o.name: values[o.name] for o in prepared.graph.output},
        overflow=int(values[OVERFLOW_OUTPUT]),
        model=prepared.model if shaped is not None else None,
    )
    for name, value in values.items():
        if name.startswith(MAGNITUDE_PREFIX):
            tensor = unsliced(name[len(MAGNITUDE_PREFIX) :])
            run.magnitude[tensor] = max(run.magnitude.get(tensor, 0.0), float(value))
        elif name.startswith(SHAPE_PREFIX):
            run.shapes[name[len(SHAPE_PREFIX) :]] = [int(d) for d in value]
    return run


_SLICE_SUFFIX = re.compile(r"__attention_heads_\d+_\d+$")  # `attention_heads._sliced` names


def unsliced(tensor: str) -> str:
    """A slice's copy of a tensor (attention split by heads) -> the tensor it is part of."""
    return _SLICE_SUFFIX.sub("", tensor)


def split_by_heads(
    prepared: PreparedGraph, precisions: Mapping[str, NodePrecision]
) -> tuple[PreparedGraph, dict[str, NodePrecision]] | None:
    """The fp32 graph with its large attention split by heads, and the precisions of its nodes:
    each slice computes as the node it was copied from, the Splits and the Concat as fp32 (they
    move values already rounded, so the emulation is the same bit for bit). None: nothing to split."""
    model = ModelProto()
    model.CopyFrom(prepared.model)  # its weights are external: a copy of the graph alone
    if not split_attention_heads(model):
        return None
    split = replace(
        _prepared(model, prepared.path),
        rounded_weights_file=prepared.rounded_weights_file,
        _rounded_weights=prepared._rounded_weights,
    )
    mapped: dict[str, NodePrecision] = {}
    for node in model.graph.node:
        origin = node.name if node.name in precisions else sliced_from(node.name)
        if origin is not None and origin in precisions:
            mapped[node.name] = precisions[origin]
    return split, mapped


def run_reference(prepared: PreparedGraph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The graph's outputs in fp32."""
    return run_beside(prepared.path, prepared.model, feeds)


def save_emulated(prepared: PreparedGraph, precisions: Mapping[str, NodePrecision], out: Path) -> Path:
    """Write the emulated graph beside the original: it reads the original's weights where it
    computes in fp32, and their fp16-rounded copies from `rounded_weights_path(out)`, written
    with it. Rounded in the graph instead, every session of it would hold both copies of each
    weight (see `PreparedGraph.rounded_weight`)."""
    if prepared.rounded_weights_file is not None:
        raise ValueError(
            f"{prepared.path.name}: a graph to keep needs `prepare`: `prepared_light` deletes its weight files"
        )
    if out.parent.resolve() != prepared.path.parent.resolve():
        raise ValueError(f"{out}: an emulated graph must sit beside {prepared.path.name} to find its weights")
    weights = rounded_weights_path(out)
    weights.unlink(missing_ok=True)  # appended to weight by weight: an older one would stay in front
    kept = replace(prepared, rounded_weights_file=weights, _rounded_weights={})
    kept, precisions = split_by_heads(kept, precisions) or (kept, precisions)
    onnx.save_model(emulated_model(kept, precisions), str(out))
    return out


def write_emulated(source: Path, mode: str, keep: Sequence[str] = ()) -> Path:
    """`source` rewritten to compute as ATC's `mode` would with `keep` in fp32, saved beside it as
    `<stem>.emulated-<mode>[-keep<hash>].onnx` (`save_emulated`). Weights the source holds inline go
    to a file beside it first: read along with the graph, a 2 GB backbone was copied several times
    over while it was rewritten."""
    listed = json.dumps([sorted(keep)], sort_keys=True).encode()
    kept = f"-keep{hashlib.sha256(listed).hexdigest()[:8]}" if keep else ""
    out = source.with_name(f"{source.stem}.emulated-{mode}{kept}.onnx")
    inline_weights = out.with_name(f"{out.stem}.fp32.weights")
    inline_weights.unlink(missing_ok=True)  # appended to weight by weight
    prepared = prepare(source, weights_to=inline_weights)
    return save_emulated(prepared, precisions_for(prepared, mode, list(keep)), out)


def write_emulated_graphs(graphs: Mapping[str, tuple[Path, str, Sequence[str]]]) -> dict[str, Path]:
    """`write_emulated` for each graph's (source, mode, keep): one call, so that one child process
    writes a whole plan's graphs (this module imports no torch: the child starts in a second)."""
    return {name: write_emulated(source, mode, keep) for name, (source, mode, keep) in graphs.items()}


def rounded_weights_path(emulated: Path) -> Path:
    """The fp16-rounded weights a saved emulated graph reads (`save_emulated`)."""
    return emulated.with_name(f"{emulated.stem}.fp16.weights")


def compare_layers(
    prepared: PreparedGraph,
    precisions: Mapping[str, NodePrecision],
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates | None = None,
    candidate: str = "emulated",
) -> LayerComparison:
    """Run fp32 and emulated side by side on `feeds`; every float node output compared. The
    first node over the gate is run once more alone on the fp32 inputs (local or accumulated)."""
    gates = gates or PrecisionGates()
    nodes, outputs = node_errors(prepared, precisions, feeds, gates)
    outputs_pass = all(passes_output_gate(e, gates) for e in outputs)
    flagged = [n for n in nodes if n.flagged]
    if flagged:
        flagged[0] = flagged[0].model_copy(update={"local": _local_error(prepared, precisions, flagged[0].node, feeds)})
    first = _finding(flagged[0], gates) if flagged else None
    return LayerComparison(
        model=str(prepared.path),
        reference="onnxruntime fp32",
        candidate=candidate,
        backend=EMULATED_BACKEND,
        nodes_compared=len(nodes),
        nodes_flagged=len(flagged),
        first=first,
        outputs=outputs,
        outputs_pass=outputs_pass,
        overflow=sum(n.worst.overflow for n in nodes),
        flagged=sorted(flagged, key=lambda n: n.worst.cosine)[:MAX_FLAGGED_LISTED],
    )


def node_errors(
    prepared: PreparedGraph,
    precisions: Mapping[str, NodePrecision],
    feeds: Mapping[str, np.ndarray],
    gates: PrecisionGates,
) -> tuple[list[NodeComparison], list[TensorError]]:
    """Every float node output and every graph output, emulated against fp32, from one side-by-side run."""
    model, stats = _comparison_model(prepared, precisions)
    values = run_beside(prepared.path, model, feeds)
    nodes = _node_comparisons(prepared, precisions, stats, values, gates)
    outputs = [
        tensor_error(o.name, values[f"stat__{o.name}"]) for o in prepared.graph.output if f"stat__{o.name}" in values
    ]
    return nodes, outputs


def _local_error(
    prepared: PreparedGraph, precisions: Mapping[str, NodePrecision], name: str, feeds: Mapping[str, np.ndarray]
) -> TensorError | None:
    """The node emulated alone on the fp32 run's inputs: the graph up to it in fp32, and one
    emulated copy of it beside the fp32 one."""
    precision = precisions.get(name, "fp32")
    node = prepared.node_named[name]
    if precision == "fp32" or has_subgraph(node):
        return None
    nodes: list[NodeProto] = _stat_constants()
    reference = _Rewriter(prepared, nodes, suffix="")
    local = _Rewriter(prepared, nodes, suffix="__loc")
    for before in prepared.graph.node:
        reference.emit(before, "fp32", list(before.input), tag="")
        if before.name == name:
            break
    local_out = local.emit(node, precision, list(node.input), tag="")
    stats = [
        _stat_nodes(prepared, nodes, o, lo, f"stat__{name}:{k}__local")
        for k, (o, lo) in enumerate(zip(node.output, local_out))
        if o in prepared.float_tensors
    ]
    outputs = [helper.make_tensor_value_info(s, TensorProto.DOUBLE, [len(_STAT_FIELDS)]) for s in stats]
    values = run_beside(prepared.path, _derived(prepared, nodes, outputs, local), feeds)
    return min((tensor_error(s, values[s]) for s in stats), key=badness, default=None)


@dataclass
class _Stats:
    """Names of the stat outputs of one node: per float output, the stat tensor."""

    emulated: dict[str, str] = field(default_factory=dict)


def _stat_constants() -> list[NodeProto]:
    return [
        helper.make_node(
            "Constant", [], [_ONE], name=f"{_ONE}__const", value=helper.make_tensor("v", TensorProto.INT64, [1], [1])
        ),
        helper.make_node(
            "Constant", [], [_ZERO], name=f"{_ZERO}__const", value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])
        ),
        helper.make_node(
            "Constant",
            [],
            [_LAST_AXIS],
            name=f"{_LAST_AXIS}__const",
            value=helper.make_tensor("v", TensorProto.INT64, [1], [-1]),
        ),
        helper.make_node(
            "Constant",
            [],
            [_NO_COUNTS],
            name=f"{_NO_COUNTS}__const",
            value=helper.make_tensor("v", TensorProto.DOUBLE, [4], [0.0] * 4),
        ),
    ]


def _comparison_model(
    prepared: PreparedGraph, precisions: Mapping[str, NodePrecision]
) -> tuple[ModelProto, dict[str, _Stats]]:
    nodes: list[NodeProto] = _stat_constants()
    reference = _Rewriter(prepared, nodes, suffix="")
    emulated = _Rewriter(prepared, nodes, suffix="__emu")
    stats: dict[str, _Stats] = {}
    outputs: list[onnx.ValueInfoProto] = []
    graph_outputs = {o.name for o in prepared.graph.output}
    for node in prepared.graph.node:
        precision = precisions.get(node.name, "fp32")
        reference.emit(node, "fp32", list(node.input), tag="")
        emu_out = emulated.emit(node, precision, [emulated.name(i) for i in node.input], tag="")
        entry = stats.setdefault(node.name, _Stats())
        for k, original in enumerate(node.output):
            if not original or original not in prepared.float_tensors:
                continue
            name = original if original in graph_outputs else f"{node.name}:{k}"
            entry.emulated[original] = _stat_nodes(prepared, nodes, original, emu_out[k], f"stat__{name}")
        outputs += [
            helper.make_tensor_value_info(s, TensorProto.DOUBLE, [len(_STAT_FIELDS)]) for s in entry.emulated.values()
        ]
    return _derived(prepared, nodes, outputs, emulated), stats


def _stat_nodes(prepared: PreparedGraph, nodes: list[NodeProto], ref: str, emu: str, out: str) -> str:
    """Nine numbers comparing `emu` with `ref` (the fp32 tensor `ref` of `prepared`), reduced
    inside the graph: sums of squares of the error and of both tensors, max abs error, max
    |reference|, inf and NaN counts of both (`_STAT_FIELDS`).

    Exactly, with inf and NaN masked out and counted, that takes several copies of the tensor
    at once (masks, masked copies, float64 casts): about eight for a full-scale attention score
    matrix, tens of GB. So the graph first sums both tensors (no copy): when the sums are finite,
    no element is inf or NaN and an `If` takes the light branch, which holds one copy, the error."""

    def add(op: str, inputs: list[str], suffix: str, **attrs) -> str:
        name = f"{out}__{suffix}"
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    total = add(
        "Add", [add("ReduceSum", [ref], "ref_sum", keepdims=0), add("ReduceSum", [emu], "emu_sum", keepdims=0)], "sum"
    )
    finite = add(
        "Not", [add("Or", [add("IsInf", [total], "sum_inf"), add("IsNaN", [total], "sum_nan")], "sum_bad")], "finite"
    )
    light = _branch(
        f"{out}__finite", lambda add: _finite_stats(add, ref, emu, prepared.ranks.get(ref), _opset(prepared.model))
    )
    exact = _branch(f"{out}__masked", lambda add: _masked_stats(add, ref, emu))
    nodes.append(helper.make_node("If", [finite], [out], name=out, then_branch=light, else_branch=exact))
    return out


def _branch(name: str, build: Callable[[Callable[..., str]], list[str]]) -> GraphProto:
    """A subgraph whose nodes `build` adds; its one output, the nine stats, concatenated."""
    nodes: list[NodeProto] = []

    def add(op: str, inputs: list[str], suffix: str, **attrs) -> str:
        out = f"{name}__{suffix}"
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    concat = add("Concat", build(add), "stats", axis=0)
    return helper.make_graph(
        nodes, name, [], [helper.make_tensor_value_info(concat, TensorProto.DOUBLE, [len(_STAT_FIELDS)])]
    )


def _as64(add: Callable[..., str], x: str, suffix: str) -> str:
    return add("Reshape", [add("Cast", [x], f"{suffix}_64", to=TensorProto.DOUBLE), _ONE], suffix)


def _finite_stats(add: Callable[..., str], ref: str, emu: str, rank: int | None, opset: int) -> list[str]:
    """The stats of two tensors without inf or NaN. Sums of squares are taken along the last
    axis in float32 first (each row's sum is as exact as the elements, a few ulps), then over
    the rows in float64; where the rank is unknown, the whole tensor is cast to float64."""

    def sum_of_squares(x: str, suffix: str) -> str:
        if not rank:
            return _as64(
                add,
                add(
                    "ReduceSumSquare",
                    [add("Cast", [x], f"{suffix}_full64", to=TensorProto.DOUBLE)],
                    f"{suffix}_s",
                    keepdims=0,
                ),
                suffix,
            )
        axes = {"axes": [-1]} if opset < 18 else {}
        rows = add("ReduceSumSquare", [x, *([_LAST_AXIS] if opset >= 18 else [])], f"{suffix}_rows", keepdims=1, **axes)
        return add(
            "Reshape",
            [
                add(
                    "ReduceSum",
                    [add("Cast", [rows], f"{suffix}_rows64", to=TensorProto.DOUBLE)],
                    f"{suffix}_s",
                    keepdims=0,
                ),
                _ONE,
            ],
            suffix,
        )

    def largest_magnitude(x: str, suffix: str) -> str:
        high, low = add("ReduceMax", [x], f"{suffix}_hi", keepdims=0), add("ReduceMin", [x], f"{suffix}_lo", keepdims=0)
        return _as64(add, add("Max", [high, add("Neg", [low], f"{suffix}_neg")], f"{suffix}_s"), suffix)

    diff = add("Sub", [emu, ref], "d")
    dd, max_abs = sum_of_squares(diff, "dd"), largest_magnitude(diff, "max_abs")  # the error's uses first: it can go
    return [
        dd,
        sum_of_squares(ref, "aa"),
        sum_of_squares(emu, "bb"),
        max_abs,
        largest_magnitude(ref, "ref_max_abs"),
        _NO_COUNTS,
    ]


def _masked_stats(add: Callable[..., str], ref: str, emu: str) -> list[str]:
    """The stats over the elements finite in both tensors (attention masks hold -inf in fp32
    too), sums of squares in float64; the infinite and NaN elements counted apart."""

    def count(mask: str, suffix: str) -> str:
        return _as64(
            add,
            add("ReduceSum", [add("Cast", [mask], f"{suffix}_f", to=TensorProto.FLOAT)], f"{suffix}_n", keepdims=0),
            suffix,
        )

    def masks(x: str, suffix: str) -> tuple[str, str, str]:
        """Where `x` is infinite, NaN, finite."""
        inf, nan = add("IsInf", [x], f"{suffix}_inf"), add("IsNaN", [x], f"{suffix}_nan")
        return inf, nan, add("Not", [add("Or", [inf, nan], f"{suffix}_bad")], f"{suffix}_ok")

    a_inf, a_nan, a_ok = masks(ref, "a")
    b_inf, b_nan, b_ok = masks(emu, "b")
    both = add("And", [a_ok, b_ok], "both")
    ref_f, emu_f = add("Where", [both, ref, _ZERO], "a_f"), add("Where", [both, emu, _ZERO], "b_f")
    diff = add("Sub", [emu_f, ref_f], "d")
    return [
        _as64(
            add, add("ReduceSumSquare", [add("Cast", [diff], "d64", to=TensorProto.DOUBLE)], "dd_s", keepdims=0), "dd"
        ),
        _as64(
            add, add("ReduceSumSquare", [add("Cast", [ref_f], "a64", to=TensorProto.DOUBLE)], "aa_s", keepdims=0), "aa"
        ),
        _as64(
            add, add("ReduceSumSquare", [add("Cast", [emu_f], "b64", to=TensorProto.DOUBLE)], "bb_s", keepdims=0), "bb"
        ),
        _as64(add, add("ReduceMax", [add("Abs", [diff], "ad")], "max_abs_s", keepdims=0), "max_abs"),
        _as64(add, add("ReduceMax", [add("Abs", [ref_f], "aabs")], "ref_max_s", keepdims=0), "ref_max_abs"),
        count(b_inf, "b_inf_n"),
        count(b_nan, "b_nan_n"),
        count(a_inf, "a_inf_n"),
        count(a_nan, "a_nan_n"),
    ]


def _opset(model: ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


_ONE = "__shape_one"
_ZERO = "__zero"
_LAST_AXIS = "__last_axis"
_NO_COUNTS = "__no_counts"  # the four inf and NaN counts of tensors with neither
_STAT_FIELDS = ("dd", "aa", "bb", "max_abs", "ref_max_abs", "emu_inf", "emu_nan", "ref_inf", "ref_nan")


def has_subgraph(node: NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def _derived(
    prepared: PreparedGraph, nodes: list[NodeProto], outputs: list[onnx.ValueInfoProto], writer: _Rewriter
) -> ModelProto:
    """A graph of `nodes` over the weights they read: `prepared`'s, and the rounded ones `writer` made.
    A weight only its rounded copy is read through is left out: ONNX Runtime would load it all the
    same (a 2 GB backbone's fp32 weights beside their rounded copy in every emulated session)."""
    read = _names_read(nodes) | {o.name for o in outputs}  # a constant can be an output itself
    weights = [t for t in [*prepared.graph.initializer, *writer.rounded_weights.values()] if t.name in read]
    return with_nodes(prepared.model, nodes, outputs, initializers=weights)


def _names_read(nodes: Iterable[NodeProto]) -> set[str]:
    """Every tensor name the nodes read, their subgraphs' (If / Loop / Scan bodies) included."""
    read: set[str] = set()
    for node in nodes:
        read.update(node.input)
        for attribute in node.attribute:
            bodies = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
            for body in bodies:
                read |= _names_read(body.node)
    return read


def with_nodes(
    model: ModelProto,
    nodes: list[NodeProto],
    outputs: list[onnx.ValueInfoProto],
    inputs: list[onnx.ValueInfoProto] | None = None,
    initializers: list[TensorProto] | None = None,
) -> ModelProto:
    """`model`'s opsets and functions around other nodes (by default its inputs and weights)."""
    graph = helper.make_graph(
        nodes,
        model.graph.name,
        list(model.graph.input) if inputs is None else inputs,
        outputs,
        initializer=list(model.graph.initializer) if initializers is None else initializers,
    )
    result = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    result.functions.extend(model.functions)
    return result


@contextmanager
def session_beside(original: Path, model: ModelProto) -> Iterator[Any]:
    """An ONNX Runtime session of a rewritten graph saved beside the original, so its external
    weights resolve; the file goes when the session does."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = False
    # In the order the nodes are written: the default order can hold every activation alive
    # (see _Rewriter.count_overflow).
    options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
    with tempfile.NamedTemporaryFile(dir=original.parent, prefix=f".{original.stem}.", suffix=".onnx") as handle:
        onnx.save_model(model, handle.name)
        yield onnxruntime.InferenceSession(handle.name, sess_options=options, providers=["CPUExecutionProvider"])


def run_beside(original: Path, model: ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of a rewritten graph (see `session_beside`)."""
    with session_beside(original, model) as session:
        wanted = {i.name for i in session.get_inputs()}
        names = [o.name for o in session.get_outputs()]
        arrays = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(names, arrays))


def run_emulated(path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of an emulated graph file (for splicing and for checks)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def tensor_error(tensor: str, stat: np.ndarray) -> TensorError:
    dd, aa, bb, max_abs, ref_max, emu_inf, emu_nan, ref_inf, ref_nan = (float(x) for x in stat)
    overflow, nan = max(0, int(emu_inf - ref_inf)), max(0, int(emu_nan - ref_nan))
    max_abs, ref_max = max(max_abs, 0.0), max(ref_max, 0.0)  # an empty tensor reduces to -inf
    if overflow or nan:
        return TensorError(tensor=tensor, cosine=0.0, max_abs=max_abs, ref_max_abs=ref_max, overflow=overflow, nan=nan)
    if not all(np.isfinite([dd, aa, bb])):  # finite elements whose squares overflow even float64
        return TensorError(tensor=tensor, cosine=1.0 if max_abs == 0.0 else 0.0, max_abs=max_abs, ref_max_abs=ref_max)
    if aa == 0.0 or bb == 0.0:
        cosine = 1.0 if aa == bb else 0.0
    else:
        cosine = float(np.clip((aa + bb - dd) / (2.0 * np.sqrt(aa * bb)), -1.0, 1.0))
    return TensorError(tensor=tensor, cosine=cosine, max_abs=max_abs, ref_max_abs=ref_max)


def _node_comparisons(
    prepared: PreparedGraph,
    precisions: Mapping[str, NodePrecision],
    stats: dict[str, _Stats],
    values: Mapping[str, np.ndarray],
    gates: PrecisionGates,
) -> list[NodeComparison]:
    result = []
    for node in prepared.graph.node:
        entry = stats.get(node.name)
        if entry is None or not entry.emulated:
            continue
        worst = min((tensor_error(t, values[s]) for t, s in entry.emulated.items()), key=badness)
        result.append(
            NodeComparison(
                node=node.name,
                op_type=node.op_type,
                precision=precisions.get(node.name, "fp32"),
                worst=worst,
                flagged=crosses(worst, gates),
            )
        )
    return result


def badness(error: TensorError) -> tuple[int, float]:
    return (-(error.overflow + error.nan), error.cosine)


def passes_output_gate(error: TensorError, gates: PrecisionGates) -> bool:
    return error.cosine >= gates.output_min_cosine and not error.overflow and not error.nan


def crosses(error: TensorError, gates: PrecisionGates) -> bool:
    return bool(error.overflow or error.nan or error.cosine < gates.node_min_cosine)


def _finding(node: NodeComparison, gates: PrecisionGates) -> LayerFinding:
    # Local when the node, fed the exact fp32 inputs, still crosses the gate on its own.
    origin = "local" if node.local is not None and crosses(node.local, gates) else "accumulated"
    return LayerFinding(node=node.node, op_type=node.op_type, origin=origin, worst=node.worst, local=node.local)
