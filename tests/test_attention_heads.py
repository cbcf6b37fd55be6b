"""Emulated attention computed a few heads at a time: the same values, a slice of the memory."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from omskills.ascend.attention_heads import split_attention_heads
from omskills.ascend.emulation import emulated_model, precisions_for, prepare, run_beside, split_by_heads
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
    scale = numpy_helper.from_array(np.array(DIM**-0.5, np.float32), "scale")
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    outputs = [vi("out", [1, TOKENS, HEADS, DIM])] + (
        [vi("probs", [1, HEADS, TOKENS, TOKENS])] if probabilities_out else []
    )
    graph = helper.make_graph(
        nodes,
        "attention",
        [vi("q", [1, HEADS, TOKENS, DIM]), vi("kt", [1, HEADS, DIM, TOKENS]), vi("v", [1, HEADS, TOKENS, DIM])],
        outputs,
        initializer=[bias, scale],
    )
    path = tmp_path / "attention.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    feeds = {
        "q": rng.normal(size=(1, HEADS, TOKENS, DIM)).astype(np.float32) * 30,
        "kt": rng.normal(size=(1, HEADS, DIM, TOKENS)).astype(np.float32) * 30,
        "v": rng.normal(size=(1, HEADS, TOKENS, DIM)).astype(np.float32),
    }
    return path, feeds


def _emulated(path):
    """The graph in force_fp16 as the emulation builds it: large attention split first, on the fp32 graph."""
    prepared = prepare(path)
    precisions = precisions_for(prepared, "force_fp16")
    prepared, precisions = split_by_heads(prepared, precisions) or (prepared, precisions)
    return emulated_model(prepared, precisions)


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
    count = helper.make_graph(
        [helper.make_node("ReduceMax", ["biased"], ["largest"], keepdims=0)],
        "then",
        [],
        [helper.make_tensor_value_info("largest", TensorProto.FLOAT, [])],
    )
    zero = helper.make_graph(
        [helper.make_node("Constant", [], ["none"], value=numpy_helper.from_array(np.float32(0)))],
        "else",
        [],
        [helper.make_tensor_value_info("none", TensorProto.FLOAT, [])],
    )
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


def _exported_attention(tmp_path):
    """Attention as the dynamo exporter writes it: K^T reshaped to a shape the graph computes
    (Shape, Slice, Concat), so plain shape inference cannot size the score tensor."""
    rng = np.random.default_rng(1)
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["q"], ["q_shape"], name="q_shape"),
        helper.make_node("Slice", ["q_shape", "zero", "two"], ["batch_heads"], name="batch_heads"),
        helper.make_node("Concat", ["batch_heads", "dim_tokens"], ["kt_shape"], name="kt_shape", axis=0),
        helper.make_node("Reshape", ["k_flat", "kt_shape"], ["kt"], name="kt"),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
        helper.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["out"], name="pv"),
    ]
    constants = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("zero", [0]), ("two", [2]), ("dim_tokens", [DIM, TOKENS]))
    ]
    graph = helper.make_graph(
        nodes,
        "exported",
        [vi("q", [1, HEADS, TOKENS, DIM]), vi("k_flat", [1, HEADS * DIM, TOKENS]), vi("v", [1, HEADS, TOKENS, DIM])],
        [vi("out", [1, HEADS, TOKENS, DIM])],
        initializer=constants,
    )
    path = tmp_path / "exported.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    feeds = {
        "q": rng.normal(size=(1, HEADS, TOKENS, DIM)).astype(np.float32) * 10,
        "k_flat": rng.normal(size=(1, HEADS * DIM, TOKENS)).astype(np.float32) * 10,
        "v": rng.normal(size=(1, HEADS, TOKENS, DIM)).astype(np.float32),
    }
    return path, feeds


def test_attention_whose_reshapes_the_graph_computes_is_split_too(tmp_path):
    path, _ = _exported_attention(tmp_path)
    model = onnx.load(str(path))
    plain = {i.name: i for i in onnx.shape_inference.infer_shapes(model).graph.value_info}
    assert not plain["scores"].type.tensor_type.shape.dim[3].HasField("dim_value")  # what plain inference sees
    assert split_attention_heads(model, min_bytes=SCORES_BYTES, slice_bytes=SCORES_BYTES // 2) == 1


def test_the_overflow_counting_run_splits_attention_first_and_counts_and_computes_the_same(tmp_path, monkeypatch):
    import omskills.ascend.attention_heads as attention_heads
    import omskills.ascend.emulation as emulation
    from omskills.ascend.emulation import prepared_light, run_emulated_with_overflow

    path, feeds = _attention(tmp_path)
    feeds = {**feeds, "q": feeds["q"] * 40}  # scores beyond fp16's range: some overflow to count
    with prepared_light(path) as prepared:
        precisions = precisions_for(prepared, "force_fp16")
        whole, whole_overflow = run_emulated_with_overflow(prepared, precisions, feeds)
        monkeypatch.setattr(attention_heads, "SPLIT_MIN_BYTES", SCORES_BYTES)  # the tiny layer made "big"
        monkeypatch.setattr(attention_heads, "SLICE_MAX_BYTES", SCORES_BYTES // HEADS)
        built = []
        monkeypatch.setattr(
            emulation, "emulated_model", lambda p, *a, **k: built.append(p.model) or emulated_model(p, *a, **k)
        )
        split, split_overflow = run_emulated_with_overflow(prepared, precisions, feeds)
    assert [n.op_type for n in built[0].graph.node].count("Softmax") == HEADS  # what ran was split, one head a slice
    assert whole_overflow > 0 and split_overflow == whole_overflow
    np.testing.assert_array_equal(split["out"], whole["out"])


def test_attention_against_a_memory_of_open_length_is_split_one_head_at_a_time(tmp_path, monkeypatch):
    import omskills.ascend.attention_heads as attention_heads

    queries, heads, dim = 4096, 2, 4  # a long known query length; the memory's length is open
    rng = np.random.default_rng(2)
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
        helper.make_node("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["out"], name="pv"),
    ]
    graph = helper.make_graph(
        nodes,
        "memory",
        [vi("q", [1, heads, queries, dim]), vi("kt", [1, heads, dim, "memory"]), vi("v", [1, heads, "memory", dim])],
        [vi("out", [1, heads, queries, dim])],
    )
    path = tmp_path / "memory.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    feeds = {
        "q": rng.normal(size=(1, heads, queries, dim)).astype(np.float32) * 5,
        "kt": rng.normal(size=(1, heads, dim, 24)).astype(np.float32) * 5,
        "v": rng.normal(size=(1, heads, 24, dim)).astype(np.float32),
    }
    monkeypatch.setattr(attention_heads, "OPEN_BESIDE_MIN_TOKENS", queries + 1)
    whole = _emulated(path)
    assert "Split" not in [n.op_type for n in whole.graph.node]  # under the line: left whole
    monkeypatch.setattr(attention_heads, "OPEN_BESIDE_MIN_TOKENS", queries)
    split = _emulated(path)
    assert [n.op_type for n in split.graph.node].count("Softmax") == heads
    np.testing.assert_array_equal(run_beside(path, split, feeds)["out"], run_beside(path, whole, feeds)["out"])


def test_a_graph_split_twice_keeps_its_node_names_unique():
    # The overflow-counting run splits the fp32 graph, then the emulated graph is offered to the split again.
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes, inputs, outputs = [], [], []
    for layer, tokens in (("small", TOKENS), ("large", 2 * TOKENS)):
        nodes += [
            helper.make_node("MatMul", [f"{layer}_q", f"{layer}_kt"], [f"{layer}_scores"], name=f"{layer}_qk"),
            helper.make_node("Softmax", [f"{layer}_scores"], [f"{layer}_probs"], name=f"{layer}_softmax", axis=-1),
            helper.make_node("MatMul", [f"{layer}_probs", f"{layer}_v"], [f"{layer}_out"], name=f"{layer}_pv"),
        ]
        inputs += [
            vi(f"{layer}_q", [1, HEADS, tokens, DIM]),
            vi(f"{layer}_kt", [1, HEADS, DIM, tokens]),
            vi(f"{layer}_v", [1, HEADS, tokens, DIM]),
        ]
        outputs.append(vi(f"{layer}_out", [1, HEADS, tokens, DIM]))
    model = helper.make_model(
        helper.make_graph(nodes, "two", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)]
    )
    assert split_attention_heads(model, min_bytes=4 * SCORES_BYTES, slice_bytes=SCORES_BYTES) == 1  # the large one
    assert (
        split_attention_heads(model, min_bytes=SCORES_BYTES, slice_bytes=SCORES_BYTES // 2) == 1
    )  # then the small one
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names))
    onnx.checker.check_model(model)


def test_shapes_of_a_graph_with_a_long_vector_are_inferred_without_data_propagation(tmp_path, monkeypatch):
    # Propagation would turn the vector's million values into dims (gigabytes): the plain inference answers.
    import omskills.onnxfiles.inspect as inspect
    from omskills.onnxfiles.inspect import inferred_shapes

    propagated = []
    infer = onnx.shape_inference.infer_shapes

    def recording(model, *args, data_prop=False, **kwargs):
        propagated.append(data_prop)
        return infer(model, *args, data_prop=data_prop, **kwargs)

    monkeypatch.setattr(inspect.onnx.shape_inference, "infer_shapes", recording)
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [
        helper.make_node("Cast", ["signal"], ["half"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["half"], ["back"], to=TensorProto.FLOAT),
    ]
    audio = helper.make_model(
        helper.make_graph(nodes, "audio", [vi("signal", [1_000_000])], [vi("back", [1_000_000])]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    assert inferred_shapes(audio, data_prop=True)["half"] == [1_000_000]
    assert True not in propagated
    exported, _ = _exported_attention(tmp_path)  # short vectors only: propagated
    inferred_shapes(onnx.load(str(exported)), data_prop=True)
    assert propagated[-1] is True
