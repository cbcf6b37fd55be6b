"""Emulated attention computed a few heads at a time: the same values, a slice of the memory."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from omskills.ascend.attention_heads import split_attention_heads
from omskills.ascend.emulation import emulated_model, precisions_for, prepare, run_beside
from onnx import TensorProto, helper, numpy_helper

HEADS, TOKENS, DIM = 4, 32, 8
SCORES_BYTES = HEADS * TOKENS * TOKENS * 4  # one [1, H, L, L] fp32 tensor


def _attention(tmp_path, probabilities_out: bool = False):
    """Exported attention as PyTorch writes it: scaled Q times K^T, a per-head bias, softmax, times V."""
    nodes = [
        helper.make_node("Mul", ["q", "scale"], ["qs"], name="scale_q"),
        helper.make_node("MatMul", ["qs", "kt"], ["scores"], name="qk"),
        helper.make_node("Add", ["scores", "bias"], ["biased"], name="add_bias"),
        helper.make_node("Softmax", ["biased"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["context"], name="pv"),
        helper.make_node("Transpose", ["context"], ["out"], name="heads_last", perm=[0, 2, 1, 3]),
    ]
    rng = np.random.default_rng(0)
    bias = numpy_helper.from_array(rng.normal(size=(1, HEADS, TOKENS, TOKENS)).astype(np.float32), "bias")
    scale = numpy_helper.from_array(np.array(DIM ** -0.5, np.float32), "scale")
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    outputs = [vi("out", [1, TOKENS, HEADS, DIM])] + ([vi("probs", [1, HEADS, TOKENS, TOKENS])] if probabilities_out else [])
    graph = helper.make_graph(nodes, "attention", [vi("q", [1, HEADS, TOKENS, DIM]), vi("kt", [1, HEADS, DIM, TOKENS]),
                                                   vi("v", [1, HEADS, TOKENS, DIM])], outputs, initializer=[bias, scale])
    path = tmp_path / "attention.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    feeds = {"q": rng.normal(size=(1, HEADS, TOKENS, DIM)).astype(np.float32) * 30,
             "kt": rng.normal(size=(1, HEADS, DIM, TOKENS)).astype(np.float32) * 30,
             "v": rng.normal(size=(1, HEADS, TOKENS, DIM)).astype(np.float32)}
    return path, feeds


def _emulated(path):
    prepared = prepare(path)
    return emulated_model(prepared, precisions_for(prepared, "force_fp16"))


def test_emulated_attention_split_by_heads_gives_bit_for_bit_the_values_of_the_whole(tmp_path):
    path, feeds = _attention(tmp_path)
    whole = _emulated(path)  # below the size worth splitting: left whole
    assert not [n for n in whole.graph.node if n.op_type == "Split"]
    split = copy.deepcopy(whole)

    assert split_attention_heads(split, min_bytes=SCORES_BYTES, slice_bytes=SCORES_BYTES // 2) == 1

    ops = [n.op_type for n in split.graph.node]
    assert ops.count("Softmax") == 2 and ops.count("Concat") == 1  # two slices of two heads each
    onnx.checker.check_model(split)
    expected, got = run_beside(path, whole, feeds)["out"], run_beside(path, split, feeds)["out"]
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(got, expected)


def test_one_slice_is_written_whole_before_the_next_so_only_one_is_alive_at_a_time(tmp_path):
    path, _ = _attention(tmp_path)
    split = _emulated(path)
    split_attention_heads(split, min_bytes=SCORES_BYTES, slice_bytes=SCORES_BYTES // HEADS)
    slices = [n.name.rsplit("_", 1)[-1] for n in split.graph.node if "__attention_heads_0_" in n.name]
    assert slices == sorted(slices, key=int) and len(set(slices)) == HEADS


@pytest.mark.parametrize("why", ["the probabilities are an output too", "too small to be worth it"])
def test_attention_whose_scores_are_read_elsewhere_or_are_small_is_left_whole(tmp_path, why):
    path, _ = _attention(tmp_path, probabilities_out=why.startswith("the probabilities"))
    model = _emulated(path)
    before = model.SerializeToString()
    min_bytes = SCORES_BYTES + 1 if why.startswith("too small") else SCORES_BYTES
    assert split_attention_heads(model, min_bytes=min_bytes, slice_bytes=SCORES_BYTES // 2) == 0
    assert model.SerializeToString() == before


def test_attention_whose_scores_a_branch_reads_is_left_whole(tmp_path):
    # An If's branches read the enclosing graph's tensors without naming them as inputs.
    path, _ = _attention(tmp_path)
    model = _emulated(path)
    count = helper.make_graph([helper.make_node("ReduceMax", ["biased"], ["largest"], keepdims=0)], "then", [],
                              [helper.make_tensor_value_info("largest", TensorProto.FLOAT, [])])
    zero = helper.make_graph([helper.make_node("Constant", [], ["none"], value=numpy_helper.from_array(np.float32(0)))],
                             "else", [], [helper.make_tensor_value_info("none", TensorProto.FLOAT, [])])
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "always"))
    model.graph.node.append(helper.make_node("If", ["always"], ["peak"], then_branch=count, else_branch=zero))
    model.graph.output.append(helper.make_tensor_value_info("peak", TensorProto.FLOAT, []))
    before = model.SerializeToString()
    assert split_attention_heads(model, min_bytes=SCORES_BYTES, slice_bytes=SCORES_BYTES // 2) == 0
    assert model.SerializeToString() == before


def test_a_saved_emulated_graph_splits_its_attention_and_runs_to_the_same_values(tmp_path, monkeypatch):
    import omskills.ascend.attention_heads as attention_heads
    from omskills.ascend.emulation import run_emulated, save_emulated

    path, feeds = _attention(tmp_path)
    prepared = prepare(path)
    whole = run_beside(path, emulated_model(prepared, precisions_for(prepared, "force_fp16")), feeds)["out"]
    # The tiny layer made "big": the graph the precision plan splices is the split one.
    monkeypatch.setattr(attention_heads, "SPLIT_MIN_BYTES", SCORES_BYTES)
    monkeypatch.setattr(attention_heads, "SLICE_MAX_BYTES", SCORES_BYTES // 2)
    out = save_emulated(prepare(path), precisions_for(prepared, "force_fp16"), tmp_path / "attention.emu.onnx")
    saved = onnx.load(str(out), load_external_data=False)
    assert [n.op_type for n in saved.graph.node].count("Softmax") == 2
    np.testing.assert_array_equal(run_emulated(out, feeds)["out"], whole)
