"""Fuse exported scaled-dot-product attention into ONNX Runtime's MultiHeadAttention, for the CPU.

PyTorch exports `scaled_dot_product_attention` as plain ONNX: MatMul(Q*s, K^T*s) [+ bias] ->
Softmax -> MatMul(., V). ONNX Runtime's CPU graph optimiser does not recognise that pattern, so it
materialises every score matrix: for 5184 image tokens and 8 heads, 860 MB written, read by the
Softmax, written again and read by the second MatMul, per attention layer. Its contrib op
`com.microsoft.MultiHeadAttention` computes the same in tiles (flash attention on the CPU) without
ever holding the matrix: two to three times faster on such a layer here, in a fraction of the memory.

The rewrite is for an ONNX Runtime session only: the ONNX file ATC compiles stays standard ONNX.
Only what is certain is rewritten: a 4-D pattern whose head count is static and whose scales are
constant scalars; anything else stays as exported.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from omskills.onnxfiles.inspect import default_opset, inferred_shapes
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class _Attention:
    query: str  # [B, H, Lq, d]
    key_t: str  # [B, H, d, Lk]
    value: str  # [B, H, Lk, d]
    bias: str | None  # additive, broadcast to [B, H, Lq, Lk]
    scale: float
    heads: int
    output: str  # [B, H, Lq, d]
    nodes: tuple[onnx.NodeProto, ...]  # the nodes the fused op replaces


class _Graph:
    """Producers, consumers, constants and inferred shapes of one graph, for matching."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        # One list of the node objects, used throughout: a node is then known by its identity.
        self.nodes = list(graph.node)
        self.producer = {out: node for node in self.nodes for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.nodes:
            for name in node.input:
                self.consumers[name].append(node)
        self.outputs = {out.name for out in graph.output}
        self.initializers = {init.name: init for init in graph.initializer}
        self.shapes = inferred_shapes(model)

    def scalar(self, name: str) -> float | None:
        """The value of a constant scalar (an initializer or a Constant node), else None."""
        tensor = self.initializers.get(name)
        node = self.producer.get(name)
        if tensor is None and node is not None and node.op_type == "Constant":
            tensor = next((a.t for a in node.attribute if a.name == "value"), None)
        if tensor is None:
            return None
        array = numpy_helper.to_array(tensor)
        return float(array.reshape(-1)[0]) if array.size == 1 else None

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def scaled(self, name: str) -> tuple[str, float, list[onnx.NodeProto]]:
        """(the tensor before a `Mul` by a constant scalar, that scalar, [the Mul]) or (name, 1.0, [])."""
        node = self.producer.get(name)
        if node is not None and node.op_type == "Mul" and self.only_consumer(name) is not None:
            for tensor, factor in (node.input, node.input[::-1]):
                value = self.scalar(factor)
                if value is not None:
                    return tensor, value, [node]
        return name, 1.0, []


def _match(graph: _Graph, softmax: onnx.NodeProto) -> _Attention | None:
    axis = next((helper.get_attribute_value(a) for a in softmax.attribute if a.name == "axis"), -1)
    scores = softmax.input[0]
    shape = graph.shapes.get(scores)
    if shape is None or len(shape) != 4 or axis not in (-1, 3):
        return None
    second = graph.only_consumer(softmax.output[0])
    if second is None or second.op_type != "MatMul" or second.input[0] != softmax.output[0]:
        return None
    nodes, bias = [softmax, second], None
    producer = graph.producer.get(scores)
    if producer is not None and producer.op_type == "Add":
        matmuls = [
            name for name in producer.input if name in graph.producer and graph.producer[name].op_type == "MatMul"
        ]
        if not matmuls or graph.only_consumer(scores) is None or graph.only_consumer(matmuls[0]) is None:
            return None
        bias = next(name for name in producer.input if name != matmuls[0])
        # MultiHeadAttention takes a bias of [B or 1, H or 1, Lq, Lk]; one broadcast along Lq (a
        # key padding mask) would have to be expanded first: left unfused (such a block attends
        # to a few prompt tokens and costs little).
        bias_shape = graph.shapes.get(bias, [])
        if len(bias_shape) != 4 or bias_shape[2:] != shape[2:] or "?" in bias_shape[2:]:
            return None
        nodes, producer = nodes + [producer], graph.producer[matmuls[0]]
    if producer is None or producer.op_type != "MatMul":
        return None
    query, query_scale, query_mul = graph.scaled(producer.input[0])
    key_t, key_scale, key_mul = graph.scaled(producer.input[1])
    query_shape, key_shape = graph.shapes.get(query, []), graph.shapes.get(key_t, [])
    value_shape = graph.shapes.get(second.input[1], [])
    if any(len(s) != 4 for s in (query_shape, key_shape, value_shape)):
        return None
    heads = query_shape[1]
    if not isinstance(heads, int) or heads < 1 or _differ(query_shape[:2], key_shape[:2], value_shape[:2]):
        return None  # MultiHeadAttention does not broadcast batch or heads as MatMul does
    return _Attention(
        query=query,
        key_t=key_t,
        value=second.input[1],
        bias=bias,
        scale=query_scale * key_scale,
        heads=heads,
        output=second.output[0],
        nodes=tuple(nodes + [producer] + query_mul + key_mul),
    )


def _differ(*dims: list[int | str]) -> bool:
    """True when two of the dims are different sizes. A symbolic dim passes: MultiHeadAttention
    checks batch and hidden sizes when it runs and fails rather than compute something else
    (OnnxRuntimeBackend then goes back to the graph as exported)."""
    return any(len({d for d in column if isinstance(d, int) and d > 0}) > 1 for column in zip(*dims))


def _fused_nodes(attention: _Attention, index: int) -> list[onnx.NodeProto]:
    """MultiHeadAttention takes query, key and value as [B, L, H*d] (given per head, [B, H, L, d],
    it takes another, unfused path); it answers [B, Lq, H*d], put back to [B, H, Lq, d]."""
    name = f"fused_attention_{index}"
    shape = f"{name}_bsd_shape"
    q_bsnh, q_bsd = f"{name}_q_bsnh", f"{name}_q_bsd"
    k_bsnh, k_bsd = f"{name}_k_bsnh", f"{name}_k_bsd"
    v_bsnh, v_bsd = f"{name}_v_bsnh", f"{name}_v_bsd"
    out_bsd, out_bsnh = f"{name}_out_bsd", f"{name}_out_bsnh"
    inputs = [q_bsd, k_bsd, v_bsd, "", "", attention.bias] if attention.bias else [q_bsd, k_bsd, v_bsd]
    return [
        helper.make_node("Transpose", [attention.query], [q_bsnh], name=f"{name}_q_transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", [q_bsnh, shape], [q_bsd], name=f"{name}_q_reshape"),
        helper.make_node("Transpose", [attention.key_t], [k_bsnh], name=f"{name}_k_transpose", perm=[0, 3, 1, 2]),
        helper.make_node("Reshape", [k_bsnh, shape], [k_bsd], name=f"{name}_k_reshape"),
        helper.make_node("Transpose", [attention.value], [v_bsnh], name=f"{name}_v_transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", [v_bsnh, shape], [v_bsd], name=f"{name}_v_reshape"),
        helper.make_node(
            "MultiHeadAttention",
            inputs,
            [out_bsd],
            name=name,
            domain=MS_DOMAIN,
            num_heads=attention.heads,
            scale=attention.scale,
        ),
        helper.make_node("Reshape", [out_bsd, f"{name}_bsnh_shape"], [out_bsnh], name=f"{name}_out_reshape"),
        helper.make_node("Transpose", [out_bsnh], [attention.output], name=f"{name}_out_transpose", perm=[0, 2, 1, 3]),
    ]


def _shape_constants(index: int, heads: int) -> list[onnx.TensorProto]:
    name = f"fused_attention_{index}"
    return [
        numpy_helper.from_array(np.array([0, 0, -1], dtype=np.int64), f"{name}_bsd_shape"),
        numpy_helper.from_array(np.array([0, 0, heads, -1], dtype=np.int64), f"{name}_bsnh_shape"),
    ]


def fuse_attention(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place; returns how many attention blocks were fused (0: left as it was)."""
    if (default_opset(model) or 0) < 13:  # Softmax's axis meant something else before opset 13
        return 0
    graph = _Graph(model)
    found = [a for a in (_match(graph, node) for node in graph.nodes if node.op_type == "Softmax") if a]
    if not found:
        return 0
    replaced = {id(node) for attention in found for node in attention.nodes}
    # Each fused block goes where its last node stood: after its inputs, before its output's users.
    position = {id(node): i for i, node in enumerate(graph.nodes)}
    last = {max(position[id(node)] for node in attention.nodes): index for index, attention in enumerate(found)}
    rebuilt: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.nodes):
        if id(node) not in replaced:
            rebuilt.append(node)
        if i in last:
            rebuilt.extend(_fused_nodes(found[last[i]], last[i]))
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
    for index, attention in enumerate(found):
        model.graph.initializer.extend(_shape_constants(index, attention.heads))
    if not any(opset.domain == MS_DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    # The fused nodes' outputs have no inferred shapes yet; stale value_info of removed tensors goes.
    removed = {out for attention in found for node in attention.nodes for out in node.output} - {
        a.output for a in found
    }
    kept_info = [info for info in model.graph.value_info if info.name not in removed]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    return len(found)
