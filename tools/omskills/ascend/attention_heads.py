"""Emulated attention computed a few heads at a time, for ONNX Runtime sessions of emulated graphs.

An emulated graph rounds each operator's output to fp16 with a pair of Casts, which hides the
attention pattern from `attention_fusion`, so every attention layer holds its score matrix
[B, H, Lq, Lk] several times over: the fp32 product, its fp16 copy, the rounded copy, the
softmax and its rounding. For 5184 image tokens and 16 heads one such tensor is 1.7 GB per
image, and the rounding roughly doubles what is alive at once.

Every operator between an attention layer's two MatMuls works on each head alone, so running
the same operators on slices of a few heads and concatenating the outputs computes exactly the
same values, with only a slice of each score-sized tensor alive at a time (the nodes of one
slice are written together, and ONNX Runtime runs them in that order). Only regions made
entirely of such operators, left through one MatMul, are rewritten; anything else stays as it
is. Exporters compute attention's reshapes in the graph (Shape, Slice, Concat), so the score
shapes are read with ONNX's data propagation.

Graphs in fp32 are left alone: without the Casts, ONNX Runtime fuses some neighbours of a split
region differently, so the values would move by float rounding, and a deployment (which imports
no `onnx`) must compute what verify computed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from omskills.onnxfiles.inspect import default_opset, inferred_shapes
from onnx import helper, numpy_helper

# Score tensors below this size are left whole: splitting them saves little and adds nodes.
SPLIT_MIN_BYTES = 64 << 20
# Heads per slice are chosen so that one slice of a score tensor stays under this size.
SLICE_MAX_BYTES = 128 << 20
# A score tensor with one length open (unknown until run) is split when its other length is at
# least this many tokens: full-scale image attention (72 x 72 patches) against a growing memory.
OPEN_BESIDE_MIN_TOKENS = 4096

_SLICE_NAME = re.compile(r"^(.*)__attention_heads_\d+_\d+$")
_CONCAT_NAME = re.compile(r"^attention_heads_\d+_concat$")

# Operators that compute each element from the elements at the same position of their inputs
# (broadcast), or along the last axis only: applied per head, they give the same values.
_ELEMENTWISE = {
    "Abs",
    "Add",
    "And",
    "Cast",
    "Clip",
    "Div",
    "Equal",
    "Erf",
    "Exp",
    "Greater",
    "GreaterOrEqual",
    "Identity",
    "IsInf",
    "IsNaN",
    "Less",
    "LessOrEqual",
    "Log",
    "Max",
    "Min",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "Pow",
    "Reciprocal",
    "Relu",
    "Sigmoid",
    "Sqrt",
    "Sub",
    "Tanh",
    "Where",
}
_LAST_AXIS = {"Softmax", "LogSoftmax"}


@dataclass(frozen=True)
class _Region:
    nodes: tuple[onnx.NodeProto, ...]  # in graph order
    exit: onnx.NodeProto  # the MatMul that reads the region and answers [B, H, Lq, d]
    split: tuple[str, ...]  # inputs sliced along the head axis
    heads: int
    slice_heads: int


def split_attention_heads(model: onnx.ModelProto, min_bytes: int | None = None, slice_bytes: int | None = None) -> int:
    """Rewrite `model` in place; returns how many attention regions now run a few heads at a time.
    Sizes default to SPLIT_MIN_BYTES and SLICE_MAX_BYTES."""
    min_bytes = SPLIT_MIN_BYTES if min_bytes is None else min_bytes
    slice_bytes = SLICE_MAX_BYTES if slice_bytes is None else slice_bytes
    if (default_opset(model) or 0) < 13:  # Split takes its sizes as an input, and Softmax its axis, from 13
        return 0
    try:
        shapes = inferred_shapes(model, data_prop=True)  # exporters compute attention's reshapes in the graph
    except Exception:  # noqa: BLE001 - a graph shape inference cannot read runs as it is
        return 0
    graph = model.graph
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    nodes = list(graph.node)
    regions = _regions(nodes, shapes, {o.name for o in graph.output}, min_bytes, slice_bytes)
    if not regions:
        return 0
    replaced = {id(n) for r in regions for n in (*r.nodes, r.exit)}
    # Numbered after the regions an earlier split of this graph made (node names must stay unique).
    first = sum(1 for n in nodes if _CONCAT_NAME.match(n.name))
    at_exit = {id(r.exit): (first + i, r) for i, r in enumerate(regions)}
    rebuilt: list[onnx.NodeProto] = []
    for node in nodes:
        if id(node) in at_exit:
            index, region = at_exit[id(node)]
            rebuilt.extend(_sliced(region, index, graph))
        elif id(node) not in replaced:
            rebuilt.append(node)
    del graph.node[:]
    graph.node.extend(rebuilt)
    gone = {o for r in regions for n in r.nodes for o in n.output}
    kept = [info for info in graph.value_info if info.name not in gone]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return len(regions)


def _score_heads(shape: list | None, min_bytes: int) -> int | None:
    """H of a [B, H, Lq, Lk] tensor at least `min_bytes` in fp32 (B unknown counts as 1), or of one
    whose other length the graph leaves open beside a long known one (a memory that grows with the
    frames seen: as large as it gets, so sliced one head at a time)."""
    if shape is None or len(shape) != 4 or not (isinstance(shape[1], int) and shape[1] > 1):
        return None
    heads, rows, cols = shape[1:]
    known = [d for d in (rows, cols) if isinstance(d, int) and d > 0]
    if len(known) == 1 and known[0] >= OPEN_BESIDE_MIN_TOKENS:
        return heads
    if len(known) < 2:
        return None
    batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else 1
    return heads if batch * heads * rows * cols * 4 >= min_bytes else None


def _reads(node: onnx.NodeProto) -> set[str]:
    """The tensors a node reads: its inputs and, for an If or a Loop, every name its branches use
    (they see the enclosing graph's tensors without listing them as inputs)."""
    names = set(node.input)
    for attribute in node.attribute:
        for body in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
            for inner in body.node:
                names |= _reads(inner)
    return names


def _separable(node: onnx.NodeProto) -> bool:
    if node.op_type in _ELEMENTWISE or node.op_type == "MatMul":
        return not node.domain or node.domain == "ai.onnx"
    if node.op_type in _LAST_AXIS:
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), -1)
        return axis in (-1, 3)
    return False


def _regions(
    nodes: list[onnx.NodeProto], shapes: dict, outputs: set[str], min_bytes: int, slice_bytes: int
) -> list[_Region]:
    """Connected groups of separable nodes whose outputs are all score tensors of one head count."""
    heads_of = {}
    for node in nodes:
        counts = {_score_heads(shapes.get(o), min_bytes) for o in node.output}
        if len(counts) == 1 and None not in counts and _separable(node):
            heads_of[id(node)] = counts.pop()
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in nodes:
        for name in _reads(node):
            consumers[name].append(node)
    seen: set[int] = set()
    found = []
    for node in nodes:
        if id(node) in heads_of and id(node) not in seen:
            group = _grow(node, heads_of, producer, consumers, seen)
            region = _region(group, nodes, shapes, consumers, outputs, heads_of[id(node)], slice_bytes)
            if region is not None:
                found.append(region)
    return found


def _grow(
    start: onnx.NodeProto, heads_of: dict, producer: dict, consumers: dict, seen: set[int]
) -> list[onnx.NodeProto]:
    group, todo = [], [start]
    seen.add(id(start))
    while todo:
        node = todo.pop()
        group.append(node)
        linked = [producer[i] for i in node.input if i in producer] + [c for o in node.output for c in consumers[o]]
        for other in linked:
            if id(other) in heads_of and id(other) not in seen and heads_of[id(other)] == heads_of[id(start)]:
                seen.add(id(other))
                todo.append(other)
    return group


def _region(
    group: list[onnx.NodeProto],
    nodes: list[onnx.NodeProto],
    shapes: dict,
    consumers: dict,
    outputs: set[str],
    heads: int,
    slice_bytes: int,
) -> _Region | None:
    inside = {id(n) for n in group}
    made = {o for n in group for o in n.output}
    if made & outputs:
        return None
    leaving = {id(c): c for o in made for c in consumers[o] if id(c) not in inside}
    if len(leaving) != 1:
        return None
    exit = next(iter(leaving.values()))
    if exit.op_type != "MatMul" or exit.input[0] not in made or exit.input[1] in made:
        return None
    order = {id(n): i for i, n in enumerate(nodes)}
    ordered = tuple(sorted(group, key=lambda n: order[id(n)]))
    entering = [i for n in (*ordered, exit) for i in n.input if i and i not in made]
    split = []
    for name in dict.fromkeys(entering):
        how = _slicing(shapes.get(name), heads)
        if how is None:
            return None
        if how:
            split.append(name)
    sample = shapes[exit.input[0]]
    if not all(isinstance(d, int) and d > 0 for d in sample[2:]):
        slice_heads = 1  # a length left open: as large as it gets
    else:
        per_head = int(np.prod([d if isinstance(d, int) and d > 0 else 1 for d in sample])) * 4 // heads
        slice_heads = max([h for h in range(1, heads + 1) if heads % h == 0 and h * per_head <= slice_bytes], default=1)
    if slice_heads == heads:
        return None
    return _Region(nodes=ordered, exit=exit, split=tuple(split), heads=heads, slice_heads=slice_heads)


def _slicing(shape: list | None, heads: int) -> bool | None:
    """True: slice along axis 1; False: every slice reads it whole (it broadcasts over heads);
    None: cannot tell."""
    if shape is None:
        return None
    if len(shape) <= 2 or all(d == 1 for d in shape):
        return False
    if len(shape) == 4 and shape[1] == 1:
        return False
    if len(shape) == 4 and shape[1] == heads:
        return True
    return None


def sliced_from(name: str) -> str | None:
    """The node a slice's copy was made from (`_sliced` names them), or None."""
    match = _SLICE_NAME.match(name)
    return match.group(1) if match else None


def _sliced(region: _Region, index: int, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The region and its exit as `heads / slice_heads` copies, one per slice, then the exit's
    output concatenated along the head axis."""
    count = region.heads // region.slice_heads
    prefix = f"attention_heads_{index}"
    sizes = f"{prefix}_sizes"
    graph.initializer.append(numpy_helper.from_array(np.full(count, region.slice_heads, dtype=np.int64), sizes))
    block = [
        helper.make_node(
            "Split", [name, sizes], [f"{name}__{prefix}_{k}" for k in range(count)], name=f"{prefix}_split_{j}", axis=1
        )
        for j, name in enumerate(region.split)
    ]
    local = {o for n in (*region.nodes, region.exit) for o in n.output} | set(region.split)
    for k in range(count):
        for node in (*region.nodes, region.exit):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = f"{node.name}__{prefix}_{k}"
            copy.input[:] = [f"{i}__{prefix}_{k}" if i in local else i for i in node.input]
            copy.output[:] = [f"{o}__{prefix}_{k}" for o in node.output]
            block.append(copy)
    out = region.exit.output[0]
    block.append(
        helper.make_node(
            "Concat", [f"{out}__{prefix}_{k}" for k in range(count)], [out], name=f"{prefix}_concat", axis=1
        )
    )
    return block
