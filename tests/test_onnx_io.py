"""Saving an exporter's output: weights copied from its files one tensor at a time."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from omskills.onnxfiles import onnx_io
from omskills.onnxfiles.onnx_io import save_onnx_streamed
from onnx import TensorProto, helper, numpy_helper


def _exported(folder):
    """A small model as an exporter leaves it: every weight (and a Constant's value) in model.onnx.data."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 8)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    shift = rng.standard_normal(8).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["shift"], value=numpy_helper.from_array(shift)),
            helper.make_node("Gemm", ["x", "w", "b"], ["g"]),
            helper.make_node("Add", ["g", "shift"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder.mkdir()
    onnx.save_model(
        model,
        str(folder / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=0,
        convert_attribute=True,
    )
    x = rng.standard_normal((2, 16)).astype(np.float32)
    return onnx.load(str(folder / "model.onnx"), load_external_data=False), x, x @ weight + bias + shift


def _run(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_a_model_under_protobufs_limit_is_written_inline_with_every_weight(tmp_path):
    model, x, expected = _exported(tmp_path / "exporter")
    assert sum(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer) == 2

    external = save_onnx_streamed(model, tmp_path / "out" / "m.onnx", tmp_path / "exporter", size=10_000)

    assert not external and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.onnx"]
    saved = onnx.load(str(tmp_path / "out" / "m.onnx"))  # parses: the graph's length is right
    onnx.checker.check_model(saved)
    assert all(t.data_location == TensorProto.DEFAULT and t.raw_data for t in saved.graph.initializer)
    assert [t.name for t in saved.graph.initializer] == ["w", "b"]
    np.testing.assert_allclose(_run(tmp_path / "out" / "m.onnx", x), expected, rtol=1e-5, atol=1e-6)


def test_a_model_over_protobufs_limit_gets_its_weights_in_one_data_file(tmp_path, monkeypatch):
    model, x, expected = _exported(tmp_path / "exporter")
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD_BYTES", 1000)

    external = save_onnx_streamed(model, tmp_path / "out" / "m.onnx", tmp_path / "exporter", size=10_000)

    assert external and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["m.onnx", "m.onnx.data"]
    (tmp_path / "exporter" / "model.onnx.data").unlink()  # nothing may still read the exporter's file
    np.testing.assert_allclose(_run(tmp_path / "out" / "m.onnx", x), expected, rtol=1e-5, atol=1e-6)
    assert (tmp_path / "out" / "m.onnx.data").stat().st_size == (16 * 8 + 8 + 8) * 4


@pytest.mark.parametrize("stored", ["inline", "external"])
def test_a_weight_file_shorter_than_its_reference_is_an_error_not_a_broken_model(tmp_path, monkeypatch, stored):
    model, _, _ = _exported(tmp_path / "exporter")
    model.graph.node[0].attribute[0].t.CopyFrom(numpy_helper.from_array(np.zeros(8, np.float32)))  # inline
    data = tmp_path / "exporter" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:520])  # the weight (512 bytes) fits, the bias does not
    if stored == "external":
        monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD_BYTES", 1000)

    with pytest.raises(ValueError, match=r"cannot save m.onnx .* holds 8 of the 32 bytes of 'b'"):
        save_onnx_streamed(model, tmp_path / "out" / "m.onnx", tmp_path / "exporter", size=10_000)
    assert not list((tmp_path / "out").iterdir())
