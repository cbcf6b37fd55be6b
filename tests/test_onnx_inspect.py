"""inspect_onnx: what an ONNX file declares, read without loading its weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from omskills.errors import InputError
from omskills.onnxfiles.inspect import inspect_onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]


def small_model(with_if: bool = False) -> onnx.ModelProto:
    """x[batch, 4] @ w[4, 4] -> Relu -> y[batch, 4], with an optional If whose branches hold nodes."""
    weight = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
    if with_if:
        branch = lambda op: helper.make_graph(  # noqa: E731
            [helper.make_node(op, ["h"], ["b"], name=f"in_{op}")],
            op,
            [],
            [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)],
        )
        inputs.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
        nodes.append(
            helper.make_node("If", ["flag"], ["z"], name="branch", then_branch=branch("Neg"), else_branch=branch("Abs"))
        )
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "small", inputs, outputs, [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests")


def test_summary_lists_io_with_symbolic_dims_opset_and_histogram(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(small_model(), path)

    summary = inspect_onnx(path)

    assert [(t.name, t.dtype, t.shape) for t in summary.inputs] == [("x", "float32", ["batch", 4])]
    assert [(t.name, t.shape) for t in summary.outputs] == [("y", ["batch", 4])]
    assert summary.symbolic_dims == ["batch"]
    assert summary.opsets == {"ai.onnx": 17}
    assert summary.ir_version == onnx.IR_VERSION
    assert summary.node_count == 2
    assert summary.op_histogram == {"MatMul": 1, "Relu": 1}
    assert summary.file_bytes == path.stat().st_size == summary.total_bytes
    assert summary.external_data.files == []
    assert summary.producer == "tests"


def test_nodes_inside_subgraphs_are_counted_apart(tmp_path):
    path = tmp_path / "if.onnx"
    onnx.save(small_model(with_if=True), path)

    summary = inspect_onnx(path)

    assert summary.node_count == 3  # MatMul, Relu, If
    assert summary.subgraph_node_count == 2  # Neg and Abs in the branches
    assert summary.op_histogram["Neg"] == summary.op_histogram["Abs"] == 1


def test_external_data_files_and_bytes_are_reported(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save(small_model(), path, save_as_external_data=True, location="ext.weights", size_threshold=0)

    summary = inspect_onnx(path)

    assert summary.external_data.files == ["ext.weights"]
    assert summary.external_data.bytes == 16 * 4  # the 4x4 float32 weight
    assert summary.external_data.missing == []
    assert summary.total_bytes == summary.file_bytes + 64


def test_missing_external_data_file_is_named(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save(small_model(), path, save_as_external_data=True, location="gone.weights", size_threshold=0)
    (tmp_path / "gone.weights").unlink()

    assert inspect_onnx(path).external_data.missing == ["gone.weights"]


def test_corrupt_file_gives_one_line_error_naming_the_path(tmp_path):
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(b"\x08\x07this is not a protobuf model at all \xff\xfe")

    with pytest.raises(InputError) as err:
        inspect_onnx(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_file_gives_clear_error(tmp_path):
    with pytest.raises(InputError, match="ONNX file not found: .*nothing.onnx"):
        inspect_onnx(tmp_path / "nothing.onnx")


def test_skill_script_prints_the_summary_as_json(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(small_model(), path)
    script = REPO / "skills" / "onnx-atc-pipeline" / "scripts" / "inspect_onnx.py"

    proc = subprocess.run(
        [sys.executable, str(script), "--path", str(path)], capture_output=True, text=True, check=True
    )

    assert json.loads(proc.stdout)["op_histogram"] == {"MatMul": 1, "Relu": 1}
