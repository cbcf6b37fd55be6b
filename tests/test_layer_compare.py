"""compare_layers against another run: an OM's dump in msit's layout (written here by hand, as
an NPU would, with one op computing differently), and the PyTorch module's own outputs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from omskills.ascend.emulation import prepare, run_beside, with_nodes
from omskills.ascend.module_outputs import module_observations
from omskills.ascend.npu_dumps import file_name_of, read_dump
from omskills.ascend.observed import align, compare_observed
from omskills.errors import InputError
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 17)]
NODES = ("/enc/fc1/MatMul", "/enc/fc1/Add", "/enc/act/Relu", "/head/MatMul", "/head/Softmax")
GE_TYPES = {"MatMul": "BatchMatMulV2", "Add": "Add", "Relu": "Relu", "Softmax": "SoftmaxV2"}


@pytest.fixture()
def mlp(tmp_path):
    """x -> MatMul -> Add -> Relu -> MatMul -> Softmax, with ONNX-exporter-like node names."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (("w1", (8, 16)), ("b1", (16,)), ("w2", (16, 4)))
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name=NODES[0]),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name=NODES[1]),
        helper.make_node("Relu", ["h1"], ["h2"], name=NODES[2]),
        helper.make_node("MatMul", ["h2", "w2"], ["logits"], name=NODES[3]),
        helper.make_node("Softmax", ["logits"], ["y"], name=NODES[4], axis=-1),
    ]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "mlp", [vi("x", TensorProto.FLOAT, [2, 8])], [vi("y", TensorProto.FLOAT, [2, 4])], initializer=weights
    )
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=OPSET), str(path))
    return prepare(path), {"x": rng.standard_normal((2, 8)).astype(np.float32)}


def _npu_run(prepared, feeds, wrong: str | None = None):
    """Every node's inputs and outputs as an NPU computing in fp16 would give them; `wrong`'s
    output is off by a third, and what follows it computes from the wrong value."""
    values = dict(feeds)
    values.update({t.name: numpy_helper.to_array(t) for t in prepared.graph.initializer})
    record = {}
    for node in prepared.graph.node:
        single = with_nodes(
            prepared.model,
            [node],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output],
            inputs=[
                helper.make_tensor_value_info(i, TensorProto.FLOAT, values[i].shape)
                for i in node.input
                if i not in {t.name for t in prepared.graph.initializer}
            ],
        )
        out = run_beside(prepared.path, single, values)[node.output[0]]
        if node.name == wrong:
            out = out * 1.33 + 0.5
        values[node.output[0]] = out
        record[node.name] = ([values[i] for i in node.input], out)
    return record


def _write_dump(folder, prepared, record, *, with_inputs=True, leave_out=(), rename=None):
    folder.mkdir(parents=True, exist_ok=True)
    by_name = {n.name: n for n in prepared.graph.node}
    for ts, (name, (inputs, output)) in enumerate(record.items(), start=1600000000000000):
        if name in leave_out:
            continue
        op = file_name_of((rename or {}).get(name, name))
        stem = f"{GE_TYPES[by_name[name].op_type]}.{op}.{ts % 97}.1.{ts}"
        np.save(folder / f"{stem}.output.0.npy", output.astype(np.float16))
        if with_inputs:
            for k, value in enumerate(inputs):
                np.save(folder / f"{stem}.input.{k}.npy", value.astype(np.float16))
    # What ATC adds to a graph is in every dump and is no node of the ONNX model.
    np.save(folder / "TransData.trans_TransData_3.5.1.1600000000000999.output.0.npy", np.zeros((2, 8), np.float16))
    return folder


def test_an_npu_dump_that_agrees_flags_nothing_and_skips_what_atc_added(mlp, tmp_path):
    prepared, feeds = mlp
    dump = read_dump(
        _write_dump(tmp_path / "dump" / "20260101000000_npy", prepared, _npu_run(prepared, feeds)), prepared
    )
    assert dump.skipped == 1 and len(dump.observed) == len(NODES)
    result = compare_observed(
        prepared,
        dump.observed,
        feeds,
        reference="onnxruntime fp32",
        candidate="NPU dump",
        backend="OM on an Ascend NPU",
    )
    assert result.nodes_compared == len(NODES) and result.nodes_flagged == 0 and result.first is None
    assert result.outputs_pass and result.outputs[0].tensor == "y" and result.outputs[0].cosine > 0.9999


def test_the_first_op_the_npu_computes_differently_is_named_and_found_local(mlp, tmp_path):
    prepared, feeds = mlp
    record = _npu_run(prepared, feeds, wrong="/enc/act/Relu")
    dump = read_dump(_write_dump(tmp_path / "dump", prepared, record), prepared)
    result = compare_observed(
        prepared,
        dump.observed,
        feeds,
        reference="onnxruntime fp32",
        candidate="NPU dump",
        backend="OM on an Ascend NPU",
    )
    assert result.first.node == "/enc/act/Relu" and result.first.op_type == "Relu"
    # Fed the NPU's own input of it, ONNX's Relu still disagrees with the NPU's output: the op itself.
    assert result.first.origin == "local" and result.first.local.cosine < 0.999
    assert {n.node for n in result.flagged} >= {"/enc/act/Relu", "/head/MatMul"}
    assert result.flagged[0].source.startswith("Relu._enc_act_Relu.")


def test_an_error_carried_in_from_an_op_not_dumped_is_accumulated(mlp, tmp_path):
    prepared, feeds = mlp
    record = _npu_run(prepared, feeds, wrong="/enc/act/Relu")
    dump = read_dump(_write_dump(tmp_path / "dump", prepared, record, leave_out={"/enc/act/Relu"}), prepared)
    result = compare_observed(
        prepared,
        dump.observed,
        feeds,
        reference="onnxruntime fp32",
        candidate="NPU dump",
        backend="OM on an Ascend NPU",
    )
    # The MatMul is first over the gate, but on the NPU's own (already wrong) input it agrees.
    assert result.first.node == "/head/MatMul" and result.first.origin == "accumulated"
    assert result.first.local.cosine > 0.999


def test_an_output_only_dump_leaves_the_origin_undetermined(mlp, tmp_path):
    prepared, feeds = mlp
    record = _npu_run(prepared, feeds, wrong="/enc/act/Relu")
    dump = read_dump(_write_dump(tmp_path / "dump", prepared, record, with_inputs=False), prepared)
    result = compare_observed(prepared, dump.observed, feeds, reference="r", candidate="c", backend="b")
    assert result.first.node == "/enc/act/Relu" and result.first.origin == "undetermined" and result.first.local is None


def _fused_json(path):
    """An OM graph JSON (atc --mode=1) where ATC fused the MatMul and the Add into one op."""
    original = {"key": "_datadump_original_op_names", "value": {"list": {"s": ["/enc/fc1/MatMul", "/enc/fc1/Add"]}}}
    path.write_text(
        json.dumps(
            {
                "graph": [
                    {
                        "name": "g",
                        "op": [
                            {
                                "name": "fc1_fused",
                                "type": "MatMulV2",
                                "attr": [original],
                                "output_desc": [{"attr": []}],
                            },
                        ],
                    }
                ]
            }
        )
    )
    return path


def test_a_fused_op_is_matched_through_the_om_graph_json_and_unmatched_without_it(mlp, tmp_path):
    prepared, feeds = mlp
    record = _npu_run(prepared, feeds)
    record["/enc/fc1/Add"] = (record["/enc/fc1/MatMul"][0], record["/enc/fc1/Add"][1])
    folder = _write_dump(
        tmp_path / "dump", prepared, record, leave_out={"/enc/fc1/MatMul"}, rename={"/enc/fc1/Add": "fc1_fused"}
    )
    without = read_dump(folder, prepared)
    plain = compare_observed(
        prepared, without.observed, feeds, reference="r", candidate="c", backend="b", notes=without.notes
    )
    assert plain.unmatched == 1 and any("om_json" in n for n in plain.notes)
    with_json = read_dump(folder, prepared, _fused_json(tmp_path / "model.json"))
    mapped = compare_observed(prepared, with_json.observed, feeds, reference="r", candidate="c", backend="b")
    assert mapped.unmatched == 0 and mapped.nodes_compared == len(NODES) - 1 and mapped.nodes_flagged == 0
    assert "/enc/fc1/Add" in {o.node for o in with_json.observed}


def test_a_raw_dump_not_yet_converted_to_npy_says_how_to_convert_it(mlp, tmp_path):
    prepared, _ = mlp
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "Relu._enc_act_Relu.3.1.1600000000000001").write_bytes(b"\0" * 16)
    with pytest.raises(InputError, match=r"dump_dir: .*1 raw dump file.*msaccucmp.py convert"):
        read_dump(raw, prepared)
    with pytest.raises(InputError, match="om_json: .*does not exist"):
        read_dump(
            _write_dump(tmp_path / "d", prepared, _npu_run(prepared, {"x": np.ones((2, 8), np.float32)})),
            prepared,
            tmp_path / "missing.json",
        )


def test_ascends_5d_layout_is_brought_back_to_nchw():
    nchw = np.arange(2 * 20 * 3 * 3, dtype=np.float32).reshape(2, 20, 3, 3)
    padded = np.concatenate([nchw, np.zeros((2, 12, 3, 3), np.float32)], axis=1)  # C1=2, C0=16
    nc1hwc0 = padded.reshape(2, 2, 16, 3, 3).transpose(0, 1, 3, 4, 2)
    assert np.array_equal(align(nc1hwc0, nchw), nchw)
    assert align(np.zeros((7,), np.float16), nchw) is None


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.act, self.norm = torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.act(self.conv(x)).permute(0, 2, 3, 1))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = _Block(), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(x).softmax(-1))


@pytest.fixture(scope="module", params=["dynamo", "torchscript"])
def exported_net(request, tmp_path_factory):
    """Both exporters: module scopes in node metadata (torch.export), or in node names (TorchScript)."""
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(1, 3, 8, 8)
    path = tmp_path_factory.mktemp("net") / "net.onnx"
    torch.onnx.export(net, (x,), str(path), dynamo=request.param == "dynamo", input_names=["x"], output_names=["y"])
    return net, x, path


def _against_module(net, x, path):
    prepared = prepare(path)
    observed, notes = module_observations(net, [x], prepared, 1 << 30)
    return observed, compare_observed(
        prepared,
        observed,
        {"x": x.numpy()},
        reference="onnx",
        candidate="pytorch",
        backend="pytorch eager (CPU)",
        notes=notes,
    )


def test_every_submodule_output_is_matched_to_its_onnx_node_and_agrees(exported_net):
    net, x, path = exported_net
    observed, result = _against_module(net, x, path)
    # The block ends on its norm's output: one tensor, compared once, for the innermost module.
    assert {o.source for o in observed} == {"module block.conv", "module block.act", "module block.norm", "module head"}
    assert result.nodes_flagged == 0 and result.unmatched == 0 and result.outputs_pass


def _edited(path, tmp_path, edit):
    model = onnx.load(str(path))
    edit(model)
    out = tmp_path / "edited.onnx"
    onnx.save(model, str(out))
    return out


def test_an_export_that_computes_a_module_wrongly_is_found_local_to_that_module(exported_net, tmp_path):
    net, x, path = exported_net

    def break_conv(model):
        conv = next(n for n in model.graph.node if n.op_type == "Conv")
        weight = next(t for t in model.graph.initializer if t.name == conv.input[1])
        weight.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(weight), weight.name))

    _, result = _against_module(net, x, _edited(path, tmp_path, break_conv))
    assert result.first.op_type == "Conv" and result.first.origin == "local"
    assert result.flagged and not result.outputs_pass


def test_an_error_outside_every_module_shows_as_accumulated_in_the_next_one(exported_net, tmp_path):
    net, x, path = exported_net

    def softmax_on_the_wrong_axis(model):
        softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
        del softmax.attribute[:]
        softmax.attribute.append(helper.make_attribute("axis", 1))

    _, result = _against_module(net, x, _edited(path, tmp_path, softmax_on_the_wrong_axis))
    # The softmax belongs to no submodule: the head is first to differ, yet on PyTorch's own input it agrees.
    assert [n.source for n in result.flagged if n.node == result.first.node] == ["module head"]
    assert result.first.origin == "accumulated" and result.first.local.cosine > 0.9999
