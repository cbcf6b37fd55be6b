"""Exported attention fused into ONNX Runtime's MultiHeadAttention for CPU sessions.

The graphs are built with onnx.helper in the shape torch's exporter gives scaled_dot_product_attention
(Q and K^T each scaled by sqrt(scale), MatMul, optional additive bias, Softmax, MatMul): small sizes,
no export, milliseconds each.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from omskills.runtime import OnnxRuntimeBackend
from omskills.runtime.attention_fusion import fuse_attention
from onnx import TensorProto, helper

B, H, LQ, LK, D = 2, 4, 16, 12, 8


def attention_model(
    bias_shape: list[int] | None = None, key_batch: int | str = B, query_batch: int | str = B, softmax_axis: int = -1
) -> onnx.ModelProto:
    """out = softmax((q*s) @ (k^T*s) [+ bias]) @ v, q [B, H, LQ, D], k and v [B, H, LK, D]."""
    nodes = [
        helper.make_node("Mul", ["q", "sqrt_scale"], ["q_scaled"]),
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["k_t", "sqrt_scale"], ["k_scaled"]),
        helper.make_node("MatMul", ["q_scaled", "k_scaled"], ["scores"]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [query_batch, H, LQ, D]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [key_batch, H, LK, D]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [key_batch, H, LK, D]),
    ]
    scores = "scores"
    if bias_shape is not None:
        nodes.append(helper.make_node("Add", ["scores", "bias"], ["biased"]))
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, bias_shape))
        scores = "biased"
    nodes += [
        helper.make_node("Softmax", [scores], ["probs"], axis=softmax_axis),
        helper.make_node("MatMul", ["probs", "v"], ["attended"]),
        helper.make_node("Transpose", ["attended"], ["out"], perm=[0, 2, 1, 3]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        inputs,
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [query_batch, LQ, H, D])],
        [helper.make_tensor("sqrt_scale", TensorProto.FLOAT, [], [D**-0.25])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(bias_shape: list[int] | None = None, key_batch: int = B) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {
        "q": rng.standard_normal((B, H, LQ, D), dtype=np.float32),
        "k": rng.standard_normal((key_batch, H, LK, D), dtype=np.float32),
        "v": rng.standard_normal((key_batch, H, LK, D), dtype=np.float32),
    }
    if bias_shape is not None:
        out["bias"] = rng.standard_normal(bias_shape, dtype=np.float32)
    return out


def reference(feed: dict[str, np.ndarray]) -> np.ndarray:
    scores = feed["q"] @ feed["k"].transpose(0, 1, 3, 2) / np.sqrt(D) + feed.get("bias", 0.0)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ feed["v"]).transpose(0, 2, 1, 3)


def ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


@pytest.mark.parametrize("bias_shape", [None, [B, H, LQ, LK], [1, 1, LQ, LK]])
def test_attention_becomes_one_multihead_attention_with_the_same_output(tmp_path, bias_shape):
    model = attention_model(bias_shape)
    assert fuse_attention(model) == 1
    assert ops(model).count("MultiHeadAttention") == 1
    assert "Softmax" not in ops(model) and "MatMul" not in ops(model)
    onnx.checker.check_model(model)
    path = tmp_path / "attention.onnx"
    onnx.save(attention_model(bias_shape), path)
    feed = feeds(bias_shape)
    with OnnxRuntimeBackend(path, fuse_attention=True) as fused, OnnxRuntimeBackend(path) as exported:
        assert (fused.fused_attention_blocks, exported.fused_attention_blocks) == (1, 0)
        got, plain = fused.run(feed)["out"], exported.run(feed)["out"]
    np.testing.assert_allclose(got, reference(feed), atol=1e-5)
    np.testing.assert_allclose(got, plain, atol=1e-5)


@pytest.mark.parametrize(
    "model, why",
    [
        (attention_model([B, 1, 1, LK]), "a bias broadcast along the queries (a key padding mask)"),
        (attention_model(key_batch=1), "a key batch that broadcasts"),
        (attention_model(softmax_axis=2), "a softmax over another axis"),
    ],
)
def test_what_multihead_attention_cannot_take_stays_as_exported(model, why):
    before = ops(model)
    assert fuse_attention(model) == 0, why
    assert ops(model) == before


def test_a_fused_block_that_fails_at_run_time_falls_back_to_the_exported_graph(tmp_path, caplog):
    # Symbolic batches pass the matcher; at run time the key's batch 1 broadcasts, which the
    # fused op refuses: the backend then runs the graph as exported, with a warning.
    path = tmp_path / "broadcast.onnx"
    onnx.save(attention_model(query_batch="batch", key_batch="key_batch"), path)
    feed = feeds(key_batch=1)
    with OnnxRuntimeBackend(path, fuse_attention=True) as backend:
        assert backend.fused_attention_blocks == 1
        out = backend.run(feed)["out"]
        assert backend.fused_attention_blocks == 0
    assert "running the graph as exported" in caplog.text
    np.testing.assert_allclose(out, reference(feed), atol=1e-5)


def test_a_model_with_nothing_to_fuse_opens_from_its_file(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with OnnxRuntimeBackend(path, fuse_attention=True) as backend:
        assert backend.fused_attention_blocks == 0
        np.testing.assert_array_equal(backend.run({"x": np.array([-1.0, 2.0], np.float32)})["y"], [0.0, 2.0])


def test_external_data_is_found_next_to_the_file_when_the_fused_model_loads_from_memory(tmp_path):
    model = attention_model()
    path = tmp_path / "external.onnx"
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="external.data",
        size_threshold=0,
    )
    feed = feeds()
    with OnnxRuntimeBackend(path, fuse_attention=True) as backend:
        assert backend.fused_attention_blocks == 1
        np.testing.assert_allclose(backend.run(feed)["out"], reference(feed), atol=1e-5)
