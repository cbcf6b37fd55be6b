"""Ascend precision emulated on CPU: hand-built graphs whose fp16 behaviour is known."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from omskills.ascend.atc import AtcOptions, build_atc_command
from omskills.ascend.emulation import (
    compare_layers,
    emulated_model,
    precisions_for,
    prepare,
    rounded_weights_path,
    run_emulated,
    run_emulated_with_overflow,
    save_emulated,
)
from omskills.ascend.pitfalls import check_pitfalls, load_pitfalls
from omskills.ascend.precision_fix import precision_report, write_keep_dtype
from omskills.errors import InputError
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 17)]


def _save(tmp_path, name, nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=OPSET), str(path))
    return path


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.fixture()
def matmul_beyond_fp16(tmp_path):
    """60 x 300 summed over 4 = 72000: above fp16's 65504."""
    weight = numpy_helper.from_array(np.full((4, 4), 300.0, np.float32), "w")
    path = _save(
        tmp_path,
        "mm",
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [_vi("x", [2, 4])],
        [_vi("y", [2, 4])],
        [weight],
    )
    return path, {"x": np.full((2, 4), 60.0, np.float32)}


@pytest.fixture()
def layernorm_softmax(tmp_path):
    """Values 1000 +- 0.01: fp16's step at 1000 is 0.5, so subtracting the mean in fp16 loses
    everything; the error starts at the Sub."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], name="mean", axes=[-1]),
        helper.make_node("Sub", ["x", "m"], ["d"], name="sub"),
        helper.make_node("Mul", ["d", "d"], ["d2"], name="square"),
        helper.make_node("ReduceMean", ["d2"], ["v"], name="variance", axes=[-1]),
        helper.make_node("Add", ["v", "eps"], ["ve"], name="add_eps"),
        helper.make_node("Sqrt", ["ve"], ["s"], name="sqrt"),
        helper.make_node("Div", ["d", "s"], ["n"], name="normalise"),
        helper.make_node("Softmax", ["n"], ["y"], name="softmax", axis=-1),
    ]
    eps = numpy_helper.from_array(np.array([1e-6], np.float32), "eps")
    path = _save(tmp_path, "ln", nodes, [_vi("x", [4, 64])], [_vi("y", [4, 64])], [eps])
    x = 1000 + 0.01 * np.random.default_rng(0).standard_normal((4, 64))
    return path, {"x": x.astype(np.float32)}


def test_a_matmul_beyond_fp16_overflows_under_force_fp16_and_passes_kept_in_fp32(matmul_beyond_fp16):
    path, feeds = matmul_beyond_fp16
    prepared = prepare(path)
    overflowed = compare_layers(prepared, precisions_for(prepared, "force_fp16"), feeds)
    assert not overflowed.outputs_pass and overflowed.outputs[0].overflow == 8
    assert overflowed.first.node == "mm" and overflowed.first.origin == "local"
    # Overflow is counted, not written as an infinite difference: JSON (and MCP clients) have no inf.
    assert json.loads(overflowed.model_dump_json())["outputs"][0]["max_abs"] == 0.0
    kept = compare_layers(prepared, precisions_for(prepared, "force_fp16", keep=["mm"]), feeds)
    assert kept.outputs_pass and kept.outputs[0].max_abs == 0.0 and kept.outputs[0].ref_max_abs == 72000.0


@pytest.fixture()
def overflow_then_scale(tmp_path):
    """A planted overflow: 60 x 300 summed over 4 = 72000 (above fp16's 65504), scaled down by 1e-3
    to 72, which fp16 holds, then a Relu: only the MatMul's output leaves fp16's range."""
    weight = numpy_helper.from_array(np.full((4, 4), 300.0, np.float32), "w")
    scale = numpy_helper.from_array(np.array([1e-3], np.float32), "s")
    path = _save(
        tmp_path,
        "mm_scaled",
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Mul", ["h", "s"], ["h2"], name="scale"),
            helper.make_node("Relu", ["h2"], ["y"], name="relu"),
        ],
        [_vi("x", [2, 4])],
        [_vi("y", [2, 4])],
        [weight, scale],
    )
    return path, {"x": np.full((2, 4), 60.0, np.float32)}


def test_a_planted_overflow_is_kept_by_calibration_alone_and_the_first_emulation_passes(overflow_then_scale, tmp_path):
    path, feeds = overflow_then_scale
    report = precision_report(path, feeds, sample="s0")
    kept = [(k.node, k.op_type, k.rule, k.figure, k.limit) for k in report.calibration.keep]
    # The MatMul writes 72000 and the Mul reads it: both would overflow in fp16.
    assert kept == [("mm", "MatMul", "overflow", 72000.0, 65520.0), ("scale", "Mul", "overflow", 72000.0, 65520.0)]
    fp16 = report.mode("force_fp16")
    # Kept before anything was emulated: the first emulation, with the Relu still in fp16, passes;
    # no search ran.
    assert fp16.result.passed and fp16.result.fp16_nodes == 1 and fp16.result.overflow == 0
    assert fp16.searched == [] and fp16.search_runs == 0 and fp16.keep == ["mm", "scale"]
    assert report.chosen_mode == "force_fp16" and report.chosen_keep == ["mm", "scale"]
    assert "2 by calibration or a known pitfall" in report.why
    # The one Cube op keeps its dtype: none of its 32 multiply-accumulates runs in fp16.
    assert (report.macs.total, report.macs.fp16, report.macs.fp16_share) == (2 * 4 * 4, 0, 0.0)
    keep_file = write_keep_dtype(report.chosen_keep, tmp_path / "om", "mm")
    assert keep_file.read_text() == "mm\nscale\n"
    options = AtcOptions.checked(
        model=str(path),
        output=str(tmp_path / "om" / "mm"),
        soc_version="Ascend910B4",
        input_shapes={"x": [2, 4]},
        precision_mode=report.chosen_mode,
        keep_dtype=str(keep_file),
    )
    command = build_atc_command(options)
    assert "--precision_mode=force_fp16" in command and f"--keep_dtype={keep_file}" in command


def test_calibration_keeps_the_consumers_of_weights_beyond_fp16_and_of_constants_it_flushes_to_zero(tmp_path):
    big = numpy_helper.from_array(np.array([1e6], np.float32), "big")  # ATC clips it to 65504
    eps = numpy_helper.from_array(np.array([1e-12], np.float32), "eps")  # 0 in fp16
    path = _save(
        tmp_path,
        "consts",
        [
            helper.make_node("Mul", ["x", "big"], ["a"], name="times_big"),
            helper.make_node("Add", ["x", "eps"], ["b"], name="plus_eps"),
            helper.make_node("Sub", ["a", "b"], ["y"], name="diff"),
        ],
        [_vi("x", [2, 4])],
        [_vi("y", [2, 4])],
        [big, eps],
    )
    from omskills.ascend.calibration import calibrate

    prepared = prepare(path)
    precisions = precisions_for(prepared, "force_fp16")
    calibration, run = calibrate(prepared, {"x": np.full((2, 4), 1e-3, np.float32)}, "s0", precisions)
    rules = {k.node: k.rule for k in calibration.keep}
    assert rules == {"times_big": "weight_range", "plus_eps": "constant_underflow"}
    # Read before its fp16 rounding: 1e-3 rounded is 0.0010004, times 1e6 (clipped to 65504 as ATC does).
    assert run.magnitude["a"] == pytest.approx(65.5, rel=1e-3) and calibration.largest == run.magnitude["a"]


def test_a_sensitive_node_no_range_rule_sees_is_found_by_the_graph_local_search_within_its_stated_runs(
    layernorm_softmax,
):
    """Values 1000 +- 0.01 stay far inside fp16's range (no calibration rule fires), but rounded to
    fp16 (a step of 0.5 at 1000) the subtraction of the mean loses everything: only the search,
    ranking nodes by the error each adds, can find what to keep."""
    from omskills.ascend.precision_fix import most_runs, ranked_by_added_error

    path, feeds = layernorm_softmax
    report = precision_report(path, feeds, sample="s0")
    assert report.calibration.keep == [] and report.calibration.largest < 2000
    fp16 = report.mode("force_fp16")
    assert not fp16.result.passed and fp16.result.cosine < 0.9
    assert "sub" in fp16.searched and fp16.with_keep.passed and fp16.with_keep.cosine >= 0.999
    prepared = prepare(path)
    precisions = precisions_for(prepared, "force_fp16")
    from omskills.ascend.emulation import node_errors
    from omskills.records.precision import PrecisionGates

    ranked = ranked_by_added_error(prepared, node_errors(prepared, precisions, feeds, PrecisionGates())[0], precisions)
    assert ranked[0] == "sub"  # the node that loses the precision ranks first
    assert fp16.search_runs <= most_runs(len(ranked)) and fp16.keep == fp16.searched
    assert report.chosen_mode == "force_fp16" and report.chosen_keep == fp16.keep
    assert "found by the graph-local search" in report.why


def test_weights_held_inline_are_not_copied_into_every_emulated_graph_and_nothing_is_left_behind(tmp_path, monkeypatch):
    from omskills.ascend import emulation

    weight = numpy_helper.from_array(np.full((64, 64), 300.0, np.float32), "w")  # 16 KB: a weight, not a shape constant
    path = _save(
        tmp_path,
        "inline",
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [_vi("x", [2, 64])],
        [_vi("y", [2, 64])],
        [weight],
    )
    before = path.read_bytes()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f".inline.onnx.{dead.stdout.strip()}.weights").write_bytes(b"left by a child the OOM killer took")
    graphs_run = []
    run_beside = emulation.run_beside

    def recording(original, model, feeds):
        graphs_run.append(model.ByteSize())
        return run_beside(original, model, feeds)

    monkeypatch.setattr(emulation, "run_beside", recording)
    report = precision_report(path, {"x": np.full((2, 64), 60.0, np.float32)}, sample="s0")
    # 60 x 300 x 64 > 65504: calibration keeps the MatMul, and nothing is left to emulate in fp16.
    assert report.chosen_keep == ["mm"] and report.calibration.keep[0].rule == "overflow"
    assert len(graphs_run) >= 1 and max(graphs_run) < weight.ByteSize()  # each graph reads the weight from a file
    assert [p.name for p in tmp_path.iterdir()] == ["inline.onnx"] and path.read_bytes() == before


def test_a_resize_keeps_its_scales_unrounded_and_readable_by_shape_inference(tmp_path):
    """A Resize's scales are a parameter, not data: never rounded, so its output size stays; and
    every small constant the emulation rounds stays inline, where ONNX Runtime's shape inference
    reads it (a rounded copy in the scratch weights file made the session fail to load)."""
    weight = numpy_helper.from_array(np.full((64, 64), 0.01, np.float32), "w")
    bias = numpy_helper.from_array(np.full((64,), 0.3, np.float32), "b")  # 256 bytes: a small constant
    scales = numpy_helper.from_array(np.array([1.0, 1.0, 1.0001, 3.0], np.float32), "scales")  # 1.0001 is 1.0 in fp16
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
        helper.make_node("Resize", ["hb", "", "scales"], ["y"], name="resize", mode="nearest"),
    ]
    path = _save(
        tmp_path, "resize", nodes, [_vi("x", [1, 1, 3, 64])], [_vi("y", [1, 1, 3, 192])], [weight, bias, scales]
    )
    report = precision_report(path, {"x": np.ones((1, 1, 3, 64), np.float32)}, sample="s0")
    fp16 = report.mode("force_fp16")
    assert fp16.result.passed and fp16.result.cosine > 0.9999, fp16.result


def test_the_bisect_names_the_subtraction_that_loses_the_normalisation_and_says_it_is_local(layernorm_softmax):
    path, feeds = layernorm_softmax
    prepared = prepare(path)
    comparison = compare_layers(prepared, precisions_for(prepared, "force_fp16"), feeds)
    assert not comparison.outputs_pass and comparison.outputs[0].cosine < 0.9
    assert comparison.first.node == "sub" and comparison.first.origin == "local"
    # Kept in fp32, the subtraction still receives the mean rounded to fp16 (step 0.5 at 1000):
    # its error now comes from its input, accumulated; keeping the mean too clears it.
    kept_sub = compare_layers(prepared, precisions_for(prepared, "force_fp16", keep=["sub"]), feeds)
    assert kept_sub.first.node == "sub" and kept_sub.first.origin == "accumulated"
    assert compare_layers(prepared, precisions_for(prepared, "force_fp16", keep=["sub", "mean"]), feeds).first is None


def test_once_the_fastest_mode_passes_the_slower_ones_are_not_emulated_and_say_so(layernorm_softmax):
    report = precision_report(*layernorm_softmax, sample="s0")
    assert [m.mode for m in report.modes] == ["force_fp16", "must_keep_origin_dtype"]
    assert report.not_evaluated == ["allow_mix_precision", "allow_fp32_to_fp16"]
    assert "not emulated, as slower: allow_mix_precision, allow_fp32_to_fp16" in report.why


def test_allow_fp32_to_fp16_rounds_only_the_cube_ops_and_must_keep_origin_dtype_none(
    layernorm_softmax, matmul_beyond_fp16
):
    ln = prepare(layernorm_softmax[0])
    assert set(precisions_for(ln, "allow_fp32_to_fp16").values()) == {"fp32"}
    assert set(precisions_for(ln, "force_fp16").values()) == {"fp16"}
    mm = prepare(matmul_beyond_fp16[0])
    assert precisions_for(mm, "allow_fp32_to_fp16") == {"mm": "fp16"}
    assert precisions_for(mm, "cube_fp16in_fp32out") == {"mm": "fp16_in"}
    report = precision_report(layernorm_softmax[0], layernorm_softmax[1], sample="s0")
    untouched = report.mode("must_keep_origin_dtype")
    assert untouched.result.fp16_nodes == 0 and untouched.result.passed and "fp32" in untouched.note


def test_weights_beyond_fp16_are_clipped_as_atc_does_not_turned_to_inf(tmp_path):
    scale = numpy_helper.from_array(np.array([1e6], np.float32), "scale")
    path = _save(
        tmp_path,
        "scale",
        [helper.make_node("Mul", ["x", "scale"], ["y"], name="mul")],
        [_vi("x", [3])],
        [_vi("y", [3])],
        [scale],
    )
    prepared = prepare(path)
    out = save_emulated(prepared, precisions_for(prepared, "force_fp16"), tmp_path / "scale.emu.onnx")
    y = run_emulated(out, {"x": np.array([1e-3, 0.5, 0.0], np.float32)})["y"]
    assert np.isfinite(y).all() and y[1] == pytest.approx(65504.0 * 0.5, rel=1e-3)
    hits = {h.id: h for h in check_pitfalls(path)}
    assert hits["large_constant_overflow"].nodes == ["mul"] and hits["weight_clip_to_fp16_range"].keep_nodes == ["mul"]


def test_a_saved_emulated_graph_reads_its_weights_already_rounded_from_a_file_beside_it(tmp_path):
    # Rounded in the graph (Clip and two Casts), ONNX Runtime folds them at load and holds the
    # original and the rounded copy of every weight: gigabytes for a full-scale backbone.
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 64)).astype(np.float32)
    path = _save(
        tmp_path,
        "big",
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [_vi("x", [2, 64])],
        [_vi("y", [2, 64])],
        [numpy_helper.from_array(w, "w")],
    )
    out = tmp_path / "big.emu.onnx"
    for _ in range(2):  # saved again, the weights file is rewritten, not appended to
        prepared = prepare(path)
        save_emulated(prepared, precisions_for(prepared, "force_fp16"), out)
    weights = rounded_weights_path(out)
    assert weights.stat().st_size == w.nbytes
    saved = onnx.load(str(out), load_external_data=False)
    assert not [n for n in saved.graph.node if n.op_type == "Clip" or "w" in n.input]
    x = rng.normal(size=(2, 64)).astype(np.float32)
    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    expected = half(half(x) @ half(w))
    np.testing.assert_allclose(run_emulated(out, {"x": x})["y"], expected, rtol=1e-6, atol=1e-6)


def test_a_convtranspose_neck_is_flagged_for_the_mixed_modes_with_its_source(tmp_path):
    weight = numpy_helper.from_array(np.ones((4, 2, 2, 2), np.float32), "w")
    path = _save(
        tmp_path,
        "neck",
        [helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="neck/up", strides=[2, 2])],
        [_vi("x", [1, 4, 3, 3])],
        [_vi("y", [1, 2, 6, 6])],
        [weight],
    )
    hit = next(h for h in check_pitfalls(path) if h.id == "fpn_convtranspose_collapse")
    assert hit.nodes == ["neck/up"] and hit.keep_nodes == ["neck/up"]
    assert {"allow_mix_precision", "allow_fp32_to_fp16"} <= set(hit.modes) and "force_fp16" not in hit.modes
    assert hit.source == "https://github.com/Ascend/pytorch/issues/125" and "emulation cannot show" in hit.note


def test_every_pitfall_is_cited_and_there_are_at_least_five():
    pitfalls = load_pitfalls()
    assert len(pitfalls) >= 5 and len({p.id for p in pitfalls}) == len(pitfalls)
    for pitfall in pitfalls:
        assert pitfall.source.startswith("https://") and pitfall.source_says and pitfall.modes


def test_nothing_emulated_is_called_an_npu_result(matmul_beyond_fp16):
    report = precision_report(*matmul_beyond_fp16, sample="s0")
    assert "not an NPU" in report.backend and "emulated" in report.backend.lower()


def test_the_overflow_count_is_the_elements_fp16_rounding_made_infinite_and_no_others(tmp_path):
    """x * 2: +-40000 -> +-80000 overflow; an inf already in x stays inf and is not counted, nor
    are the infs the Relu passes on. On inputs within fp16's range no mask is built at all."""
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["doubled"], name="double"),
        helper.make_node("Relu", ["doubled"], ["y"], name="relu"),
    ]
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    path = _save(tmp_path, "double", nodes, [_vi("x", [5])], [_vi("y", [5])], [two])
    prepared = prepare(path)
    precisions = precisions_for(prepared, "force_fp16")
    x = np.array([40000.0, -40000.0, np.inf, 1.0, np.nan], np.float32)

    outputs, overflow = run_emulated_with_overflow(prepared, precisions, {"x": x})
    assert overflow == 2 and np.isinf(outputs["y"][:3]).tolist() == [True, False, True] and np.isnan(outputs["y"][4])
    assert run_emulated_with_overflow(prepared, precisions, {"x": np.array([1, 2, 3, 4, 5], np.float32)})[1] == 0
    # The masks sit in If branches, read only when a magnitude reaches fp16's range.
    graph = emulated_model(prepared, precisions, count_overflow=True).graph
    assert not any(n.op_type == "IsInf" for n in graph.node)
    # Two per rounded output: the Relu's output is its rounded input's values, not rounded again.
    assert sum(n.op_type == "If" for n in graph.node) == 2


def test_outputs_made_of_their_rounded_inputs_values_are_not_rounded_again_and_nothing_changes(tmp_path):
    """A Transpose, a Reshape, a Relu and a Concat of fp16 values are fp16 values: rounding them is
    two Casts that change no bit. The emulation leaves them out and computes the same bits."""
    import omskills.ascend.emulation as emulation

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Transpose", ["m"], ["t"], name="transpose", perm=[1, 0]),
        helper.make_node("Reshape", ["t", "shape"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["relu"], name="relu"),
        helper.make_node("Concat", ["relu", "x_flat"], ["c"], name="concat", axis=0),
        helper.make_node("Mul", ["c", "c"], ["y"], name="square"),
    ]
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(rng.standard_normal((3, 5)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([20], np.int64), "shape"),
    ]
    path = _save(tmp_path, "moves", nodes, [_vi("x", [4, 3]), _vi("x_flat", [12])], [_vi("y", [32])], initializers)
    feeds = {
        "x": rng.standard_normal((4, 3)).astype(np.float32) * 300,
        "x_flat": rng.standard_normal(12).astype(np.float32),
    }
    prepared = prepare(path)
    precisions = precisions_for(prepared, "force_fp16")
    casts = lambda: sum(n.op_type == "Cast" for n in emulated_model(prepared, precisions).graph.node)  # noqa: E731

    moved, moved_casts = run_emulated_with_overflow(prepared, precisions, feeds)[0]["y"], casts()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(emulation, "VALUE_PRESERVING_OPS", frozenset())
        rounded, rounded_casts = run_emulated_with_overflow(prepared, precisions, feeds)[0]["y"], casts()

    assert moved.tobytes() == rounded.tobytes()
    assert rounded_casts - moved_casts == 2 * 4  # two Casts for each of the four value-preserving outputs
    assert not np.array_equal(moved, emulation.run_reference(prepared, feeds)["y"])  # and fp16 did round


def test_keep_dtype_under_must_keep_origin_dtype_is_refused(tmp_path, matmul_beyond_fp16):
    with pytest.raises(InputError, match="keep_dtype has no effect"):
        AtcOptions.checked(
            model=str(matmul_beyond_fp16[0]),
            output=str(tmp_path / "mm"),
            soc_version="Ascend910B4",
            input_shapes={"x": [2, 4]},
            precision_mode="must_keep_origin_dtype",
            keep_dtype="k.cfg",
        )


def test_the_layer_figures_of_finite_tensors_are_those_numpy_computes_from_the_two_runs(tmp_path):
    """One Mul under force_fp16, emulated here in numpy: its inputs and output rounded to fp16,
    the product in fp32. The graph's figures (taken on the light branch, as nothing is inf)
    equal numpy's in float64."""
    scale = numpy_helper.from_array(np.array(1.37, np.float32), "scale")
    path = _save(
        tmp_path,
        "mul",
        [helper.make_node("Mul", ["x", "scale"], ["y"], name="mul")],
        [_vi("x", [3, 5, 7])],
        [_vi("y", [3, 5, 7])],
        [scale],
    )
    x = np.random.default_rng(3).standard_normal((3, 5, 7)).astype(np.float32) * 10
    prepared = prepare(path)

    result = compare_layers(prepared, precisions_for(prepared, "force_fp16"), {"x": x})

    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    reference = (x * np.float32(1.37)).astype(np.float64)
    emulated = half(half(x) * half(np.float32(1.37))).astype(np.float64)
    cosine = reference.ravel() @ emulated.ravel() / np.linalg.norm(reference) / np.linalg.norm(emulated)
    [output] = result.outputs
    assert output.max_abs == pytest.approx(np.abs(emulated - reference).max(), rel=1e-6)
    assert output.ref_max_abs == pytest.approx(np.abs(reference).max(), rel=1e-6)
    assert output.cosine == pytest.approx(cosine, abs=1e-9) and output.cosine < 1.0
    assert output.overflow == output.nan == 0


def test_a_mask_that_is_minus_inf_in_fp32_too_is_compared_over_its_finite_elements(tmp_path):
    """An attention mask adds -inf in both runs: that is no overflow, and the rest is compared."""
    mask = numpy_helper.from_array(np.where(np.arange(8) % 2, -np.inf, 0.0).astype(np.float32).reshape(1, 8), "mask")
    nodes = [
        helper.make_node("Add", ["x", "mask"], ["masked"], name="add_mask"),
        helper.make_node("Mul", ["masked", "x"], ["y"], name="scale"),
    ]
    path = _save(tmp_path, "masked", nodes, [_vi("x", [2, 8])], [_vi("y", [2, 8])], [mask])
    prepared = prepare(path)
    x = {"x": np.linspace(0.5, 3.0, 16, dtype=np.float32).reshape(2, 8)}
    result = compare_layers(prepared, precisions_for(prepared, "force_fp16"), x)
    assert result.overflow == 0 and result.nodes_flagged == 0 and result.outputs_pass
    [output] = result.outputs
    assert output.cosine > 0.9999 and 0 < output.max_abs < 1e-2 and np.isfinite(output.ref_max_abs)


def test_the_modes_are_compared_with_the_pytorch_outputs_the_study_captured_when_given(layernorm_softmax):
    path, feeds = layernorm_softmax
    x = feeds["x"].astype(np.float64)
    n = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    exact = np.exp(n - n.max(-1, keepdims=True))
    captured = {"y": (exact / exact.sum(-1, keepdims=True)).astype(np.float32)}  # what PyTorch gave

    report = precision_report(path, feeds, sample="s0", outputs=captured)
    assert report.reference == "PyTorch's outputs for the sample"
    assert report.chosen_mode == "force_fp16" and report.chosen_keep == precision_report(path, feeds, "s0").chosen_keep
    assert report.calibration.sample == "s0" and report.calibration.tensors == 8  # every node output
    # Outputs that are not the graph's (another contract's names) are not used: the graph runs in fp32.
    other = precision_report(path, feeds, sample="s0", outputs={"logits": captured["y"]})
    assert other.reference == "the graph in fp32 on ONNX Runtime"


def test_a_small_graph_is_emulated_in_process_and_a_big_or_unreadable_one_in_a_child(tmp_path, matmul_beyond_fp16):
    from omskills.isolation import run_in_child
    from omskills.stages.precision import emulation_runner

    small, feeds = matmul_beyond_fp16
    runner = emulation_runner(small, feeds)
    assert runner is not run_in_child
    assert runner(precision_report, small, feeds, "sample").chosen_mode  # a plain call here
    # An attention-sized score matrix: 8 x 4096 x 4096 fp32 is 512 MB, and an emulation holds several.
    scores = _save(
        tmp_path,
        "scores",
        [
            helper.make_node("MatMul", ["q", "k"], ["s"], name="qk"),
            helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        ],
        [_vi("q", [8, 4096, 16]), _vi("k", [8, 16, 4096])],
        [_vi("p", [8, 4096, 4096])],
    )
    big_feeds = {"q": np.zeros((8, 4096, 16), np.float32), "k": np.zeros((8, 16, 4096), np.float32)}
    assert emulation_runner(scores, big_feeds) is run_in_child
    # A node of a domain shape inference cannot read: sizes unknown, so the safe place.
    custom = _save(
        tmp_path,
        "custom",
        [helper.make_node("Mystery", ["x"], ["y"], name="m", domain="vendor")],
        [_vi("x", [2, 4])],
        [_vi("y", None)],
    )
    assert emulation_runner(custom, {"x": np.zeros((2, 4), np.float32)}) is run_in_child


def test_an_emulated_graph_of_an_inline_source_reads_the_weights_it_keeps_in_fp32_from_a_file(tmp_path):
    # Read along with the graph, a 2 GB backbone held inline was copied several times over while
    # its emulated graph was built; `prepare(weights_to=...)` moves them to a file first.
    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 64)).astype(np.float32)
    path = _save(
        tmp_path,
        "inline",
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [_vi("x", [2, 64])],
        [_vi("y", [2, 64])],
        [numpy_helper.from_array(w, "w")],
    )
    weights = tmp_path / "inline.emulated.fp32.weights"
    prepared = prepare(path, weights_to=weights)
    out = tmp_path / "inline.emulated.onnx"
    save_emulated(prepared, precisions_for(prepared, "must_keep_origin_dtype"), out)
    assert weights.stat().st_size == w.nbytes and out.stat().st_size < w.nbytes  # the graph holds no weight bytes
    assert (
        onnx.load(str(path), load_external_data=False).graph.initializer[0].raw_data == w.tobytes()
    )  # source untouched
    x = rng.normal(size=(2, 64)).astype(np.float32)
    np.testing.assert_allclose(run_emulated(out, {"x": x})["y"], x @ w, rtol=1e-5, atol=1e-5)


def test_cube_macs_count_matrix_products_and_recurrent_gates_from_the_recorded_shapes(tmp_path):
    from omskills.ascend.calibration import calibrate, cube_macs

    seq, batch, inputs, hidden = 5, 2, 3, 4
    w = numpy_helper.from_array(np.ones((1, 4 * hidden, inputs), np.float32) * 0.1, "W")
    r = numpy_helper.from_array(np.ones((1, 4 * hidden, hidden), np.float32) * 0.1, "R")
    proj = numpy_helper.from_array(np.ones((hidden, 6), np.float32), "P")
    path = _save(
        tmp_path,
        "rnn",
        [
            helper.make_node("LSTM", ["x", "W", "R"], ["", "h"], name="lstm", hidden_size=hidden),
            helper.make_node("MatMul", ["h", "P"], ["y"], name="project"),
        ],
        [_vi("x", [seq, batch, inputs])],
        [_vi("y", [1, batch, 6])],
        [w, r, proj],
    )
    feeds = {"x": np.ones((seq, batch, inputs), np.float32)}
    prepared = prepare(path)
    _, run = calibrate(prepared, feeds, "s0", precisions_for(prepared, "force_fp16"))
    macs = cube_macs(run.model, run.shapes)
    assert macs == {"lstm": seq * batch * 4 * hidden * (inputs + hidden), "project": batch * 6 * hidden}


def test_an_emulated_graph_carries_only_the_weights_its_nodes_read_and_a_constant_output(tmp_path):
    """A weight read only through its rounded copy is left out (ONNX Runtime would load it too); a
    constant that is itself a graph output stays."""
    weight = numpy_helper.from_array(np.full((64, 64), 0.5, np.float32), "w")  # 16 KB: rounded in a file
    shape = numpy_helper.from_array(np.array([2.0, 64.0], np.float32), "shape")
    path = _save(
        tmp_path,
        "weights",
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [_vi("x", [2, 64])],
        [_vi("y", [2, 64]), _vi("shape", [2])],
        [weight, shape],
    )
    from omskills.ascend.emulation import prepared_light

    with prepared_light(path) as prepared:
        model = emulated_model(prepared, precisions_for(prepared, "force_fp16"))
        names = {t.name for t in model.graph.initializer}
        assert "w" not in names and "w__fp16" in names and "shape" in names
        outputs = run_emulated_with_overflow(
            prepared, precisions_for(prepared, "force_fp16"), {"x": np.ones((2, 64), np.float32)}
        )[0]
    assert outputs["shape"].tolist() == [2.0, 64.0] and np.allclose(outputs["y"], 32.0)


def test_a_mask_constant_atc_clips_to_the_largest_fp16_is_saturated_not_out_of_range(tmp_path):
    """An attention mask's -inf constant becomes -65504 once ATC clips it, and a sum with it stays
    at -65504 in fp16: no calibration rule keeps the nodes that carry it."""
    mask = numpy_helper.from_array(np.array([[0.0, -np.inf]], np.float32), "mask")
    path = _save(
        tmp_path,
        "masked",
        [
            helper.make_node("Add", ["x", "mask"], ["s"], name="add_mask"),
            helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=-1),
        ],
        [_vi("x", [1, 2])],
        [_vi("y", [1, 2])],
        [mask],
    )
    from omskills.ascend.calibration import calibrate

    prepared = prepare(path)
    calibration, run = calibrate(
        prepared, {"x": np.array([[1.0, 3.0]], np.float32)}, "s0", precisions_for(prepared, "force_fp16")
    )
    assert run.magnitude["s"] == pytest.approx(65501.0) and calibration.keep == []


def test_a_plan_recorded_when_the_check_bisected_graphs_still_loads():
    from omskills.records.precision import PrecisionPlan

    old = {"verdict": "fail", "modes": {"a": "must_keep_origin_dtype"}, "narrowed_to": ["a"], "runs": 3}
    plan = PrecisionPlan.model_validate({**old, "budget": 3, "seconds": 1.0, "why": "no plan passed"})
    assert plan.verdict == "fail" and "narrowed_to" not in plan.model_dump()


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMax's axes: an attribute, then an input
def test_calibration_reads_each_tensors_largest_finite_magnitude_by_rows_as_numpy_does(tmp_path, opset):
    from omskills.ascend.calibration import calibrate

    rng = np.random.default_rng(4)
    mask = np.zeros((1, 5), np.float32)
    mask[0, 3] = -np.inf
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["squared"], name="square"),
        helper.make_node("Add", ["squared", "mask"], ["masked"], name="add_mask"),
        helper.make_node("ReduceSum", ["masked"], ["total"], name="total", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "rows",
        [_vi("x", [3, 4, 5])],
        [_vi("masked", [3, 4, 5]), _vi("total", [])],
        initializer=[numpy_helper.from_array(mask, "mask")],
    )
    path = tmp_path / "rows.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    x = (rng.standard_normal((3, 4, 5)) * 30).astype(np.float32)
    prepared = prepare(path)
    _, run = calibrate(prepared, {"x": x}, "s0", precisions_for(prepared, "must_keep_origin_dtype"))

    squared = x * x
    assert run.magnitude["squared"] == pytest.approx(float(np.abs(squared).max()))
    assert run.magnitude["masked"] == pytest.approx(float(np.abs(np.delete(squared, 3, axis=2)).max()))  # -inf left out
    assert run.magnitude["total"] == 0.0  # a sum with -inf: no finite value
    observed = emulated_model(prepared, precisions_for(prepared, "must_keep_origin_dtype"), observe=[]).graph.node
    by_rows = {n.input[0] for n in observed if n.op_type == "ReduceMax" and n.output[0].endswith("__rows")}
    assert by_rows == {"squared", "masked"}  # the scalar is reduced whole
