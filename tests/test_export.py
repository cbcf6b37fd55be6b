"""omskills.convert.export: the contract wrapper and export_onnx, on a toy candidate.

Export writes an ONNX file whose inputs and outputs are the contract's (names, order, dynamic
batch), which ONNX Runtime runs to the same numbers as PyTorch; it targets an opset ATC accepts;
it keeps everything the exporter prints out of stdout; a failure keeps its log and says why.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from export_helpers import BATCH_DIMS, capture_head_contract, head_inputs, make_host
from omskills.contracts import capture_contracts
from omskills.contracts.pytree import flatten
from omskills.convert.export import (
    ATC_MAX_OPSET,
    ContractWrapper,
    ExportError,
    dynamic_dims_from_strategy,
    export_onnx,
)
from omskills.errors import InputError
from omskills.records.contracts import ShapeStrategy
from torch import nn


@pytest.fixture(scope="module")
def host():
    return make_host()


@pytest.fixture(scope="module")
def contract(host):
    return capture_head_contract(host)


def ort_outputs(path, inputs: list[torch.Tensor]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = ["x", "pair_0", "pair_1"]
    taken = {i.name for i in session.get_inputs()}
    feeds = {n: t.numpy() for n, t in zip(names, inputs) if n in taken}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def torch_outputs(host, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = host.head(inputs[0], (inputs[1], inputs[2]), scale=2.0, mode="sum")
    return {"y": out["y"], "extra_0": out["extra"][0], "extra_1": out["extra"][1], "best": out["best"]}


def test_wrapper_takes_flat_tensors_and_returns_the_flat_tensor_outputs(host, contract):
    wrapper = ContractWrapper(host.head, contract)
    inputs = head_inputs(2)
    with torch.no_grad():
        flat = wrapper(*inputs)
    expected = torch_outputs(host, inputs)
    assert [o.name for o in contract.outputs] == list(expected)
    for got, want in zip(flat, expected.values()):
        torch.testing.assert_close(got, want)


def test_wrapper_binds_the_recorded_constants(host, contract):
    # The capture saw scale=2.0, mode="sum"; the wrapper must call the head with exactly those.
    seen = {}
    hook = host.head.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            ContractWrapper(host.head, contract)(*head_inputs(2))
    finally:
        hook.remove()
    assert seen == {"scale": 2.0, "mode": "sum"}


def test_a_constant_without_recorded_value_needs_one_from_a_sample(host, contract):
    args = [
        a.model_copy(update={"value": None}) if a.tree_path == "kwargs['mode']" else a for a in contract.non_tensor_args
    ]
    repr_only = contract.model_copy(update={"non_tensor_args": args})
    with pytest.raises(InputError, match=r"kwargs\['mode'\].*constants="):
        ContractWrapper(host.head, repr_only)
    wrapper = ContractWrapper(host.head, repr_only, constants={"kwargs['mode']": "sum"})
    assert wrapper.constants == [2.0, "sum"]


def test_a_varying_constant_cannot_be_bound(host, contract):
    args = [
        a.model_copy(update={"constant": False}) if a.tree_path == "kwargs['scale']" else a
        for a in contract.non_tensor_args
    ]
    with pytest.raises(InputError, match=r"kwargs\['scale'\] varies across calls"):
        ContractWrapper(host.head, contract.model_copy(update={"non_tensor_args": args}))


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_export_runs_in_onnxruntime_like_torch_at_any_batch(host, contract, tmp_path, capfd, exporter):
    result = export_onnx(
        host.head, contract, head_inputs(2), tmp_path / "head.onnx", dynamic_dims=BATCH_DIMS, exporter=exporter
    )

    assert capfd.readouterr().out == ""  # exporter chatter goes to the log, never stdout
    assert result.exporter == exporter
    assert result.opset == ATC_MAX_OPSET and result.converted_from_opset is None
    assert result.output_names == ["y", "extra_0", "extra_1", "best"]
    assert result.input_names == ["x", "pair_0", "pair_1"]
    assert "CANN" in result.fact_source and "18" in result.fact_source
    assert not result.external_data
    data = (tmp_path / "head.onnx").read_bytes()
    assert result.sha256 == hashlib.sha256(data).hexdigest() and result.bytes == len(data)
    assert (tmp_path / "head.onnx.export.log").read_text().startswith(f"# export of head (head) with the {exporter}")

    model = onnx.load(result.path)
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim] == ["batch", ""]
    for batch in (1, 7):  # neither was seen at capture: the batch dim is symbolic
        inputs = head_inputs(batch)
        got, want = ort_outputs(result.path, inputs), torch_outputs(host, inputs)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_exporter_opset_above_the_target_is_converted_down(host, contract, tmp_path):
    result = export_onnx(
        host.head, contract, head_inputs(2), tmp_path / "head.onnx", exporter="dynamo", opset=17, exporter_opset=18
    )
    assert (result.opset, result.converted_from_opset) == (17, 18)
    assert onnx.load(result.path).opset_import[0].version == 17
    inputs = head_inputs(2)
    np.testing.assert_allclose(
        ort_outputs(result.path, inputs)["y"], torch_outputs(host, inputs)["y"].numpy(), rtol=1e-5, atol=1e-6
    )


def test_an_opset_above_what_atc_accepts_is_refused(host, contract, tmp_path):
    with pytest.raises(InputError, match=r"opset: 19 is outside what ATC accepts \(9\.\.18; .*CANN"):
        export_onnx(host.head, contract, head_inputs(2), tmp_path / "head.onnx", opset=19)


def test_a_conversion_onnx_cannot_do_fails_with_the_reason(tmp_path):
    # GELU became an ONNX op in opset 20; there is no older form to convert it to.
    host = nn.Sequential(nn.GELU()).eval()
    [contract] = _capture_single(host, torch.randn(2, 3))
    with pytest.raises(ExportError, match=r"No Previous Version of Gelu"):
        export_onnx(host[0], contract, [torch.randn(2, 3)], tmp_path / "gelu.onnx", exporter_opset=20)


def test_a_model_too_big_for_protobuf_gets_one_external_data_file(tmp_path, monkeypatch):
    from omskills.onnxfiles import onnx_io

    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD_BYTES", 0)  # every model counts as big
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))  # 16 KiB weights: external
    host = nn.Sequential(mlp).eval()
    x = torch.randn(2, 64)
    [contract] = _capture_single(host, x)
    result = export_onnx(mlp, contract, [x], tmp_path / "mlp.onnx")
    assert result.external_data
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".log")) == ["mlp.onnx", "mlp.onnx.data"]
    both = (tmp_path / "mlp.onnx").read_bytes() + (tmp_path / "mlp.onnx.data").read_bytes()
    assert result.bytes == len(both) and result.sha256 == hashlib.sha256(both).hexdigest()
    session = ort.InferenceSession(result.path, providers=["CPUExecutionProvider"])
    [got] = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, mlp(x).numpy(), rtol=1e-5, atol=1e-6)


@torch.library.custom_op("omskills_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """An operator no exporter can translate."""
    return x.clone()


@opaque.register_fake
def _(x):
    return torch.empty_like(x)


class Opaque(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return opaque(x) + 1


def _capture_single(host: nn.Module, x: torch.Tensor):
    """The contract of host[0] (the candidate "block") on one call."""
    return capture_contracts(host, {"block": "0"}, lambda: host(x))


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_a_failed_export_keeps_its_log_and_names_the_candidate(tmp_path, capfd, exporter):
    host = nn.Sequential(Opaque()).eval()
    [contract] = _capture_single(host, torch.randn(2, 3))
    log = tmp_path / "block.log"
    (tmp_path / "block.onnx").write_bytes(b"an earlier export")
    with pytest.raises(ExportError) as failure:
        export_onnx(host[0], contract, [torch.randn(2, 3)], tmp_path / "block.onnx", exporter=exporter, log_path=log)

    message = str(failure.value)
    assert message.startswith(
        f"export of block with the {exporter} exporter failed: an operator with no ONNX translation: "
    )
    assert "omskills_test" in message and str(log) in message and "\n" not in message
    assert "Traceback" in log.read_text()
    assert not (tmp_path / "block.onnx").exists()  # nothing stale looks like this export's result
    assert capfd.readouterr().out == ""


def test_inputs_that_do_not_match_the_contract_are_refused(host, contract, tmp_path):
    with pytest.raises(InputError, match="expected 3 tensors in contract order, got 2"):
        export_onnx(host.head, contract, head_inputs(2)[:2], tmp_path / "head.onnx")
    with pytest.raises(InputError, match="x is float64, the contract says float32"):
        export_onnx(host.head, contract, head_inputs(2, torch.float64), tmp_path / "head.onnx")
    with pytest.raises(InputError, match="'z' is not an input or output"):
        export_onnx(host.head, contract, head_inputs(2), tmp_path / "head.onnx", dynamic_dims={"z": {0: "b"}})


def test_dynamic_dims_follow_the_shape_strategy(contract):
    batch = ShapeStrategy(
        kind="dynamic_batch_size", input_shapes={"x": [-1, 4], "pair_0": [-1, 3]}, gears=[[1], [2]], rationale="test"
    )
    assert dynamic_dims_from_strategy(contract, batch) == {"x": {0: "batch"}, "pair_0": {0: "batch"}}
    dims = ShapeStrategy(kind="dynamic_dims", input_shapes={"x": [-1, -1]}, gears=[[1, 4]], rationale="test")
    assert dynamic_dims_from_strategy(contract, dims) == {"x": {0: "x_d0", 1: "x_d1"}}


def test_flat_outputs_of_the_wrapper_follow_the_contract_paths(host, contract):
    with torch.no_grad():
        out = flatten(host.head(*head_inputs(2)[:1], (torch.zeros(2, 3), torch.zeros(2, 3)), scale=2.0))
    tensor_paths = [p for p, leaf in zip(out.paths, out.leaves) if isinstance(leaf, torch.Tensor)]
    assert tensor_paths == [o.tree_path for o in contract.outputs]
    assert [a.tree_path for a in contract.non_tensor_outputs] == ["out['n']"]


@torch._dynamo.disable
def _untraceable_by_dynamo(x: torch.Tensor) -> torch.Tensor:
    """Like the portability layer's factory wrappers: strict (dynamo) capture cannot go through."""
    return x * 1.0


class SizeCached(nn.Module):
    """A module written for torch.compile, like SAM's grounding decoder: a feature size read from
    a tensor is compared with a cached one unless torch.compile is tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.stored_size = (4, 4)
        self.register_buffer("grid", torch.arange(16.0).reshape(4, 4))

    def forward(self, x: torch.Tensor, spatial_shapes: torch.Tensor) -> torch.Tensor:
        size = (spatial_shapes[0, 0], spatial_shapes[0, 1])
        if torch.compiler.is_dynamo_compiling() or self.stored_size == size:
            grid = self.grid
        else:
            grid = torch.zeros(int(size[0]), int(size[1]))
        return _untraceable_by_dynamo(x) + grid


def test_a_data_dependent_guard_is_exported_on_the_models_compile_path(tmp_path):
    block = SizeCached().eval()
    x, shapes = torch.randn(2, 4, 4), torch.tensor([[4, 4]])
    [contract] = capture_contracts(nn.ModuleDict({"block": block}), {"block": "block"}, lambda: block(x, shapes))
    result = export_onnx(block, contract, [x, shapes], tmp_path / "block.onnx")

    assert result.capture == "compile_path" and "GuardOnDataDependentSymNode" in result.capture_reason
    assert "retrying with torch.compiler.is_dynamo_compiling() reporting True" in open(result.log_path).read()
    session = ort.InferenceSession(result.path, providers=["CPUExecutionProvider"])
    taken = {i.name for i in session.get_inputs()}
    feeds = {spec.name: t.numpy() for spec, t in zip(contract.inputs, [x, shapes]) if spec.name in taken}
    np.testing.assert_allclose(session.run(None, feeds)[0], (x + block.grid).numpy(), atol=1e-6)
    assert torch.compiler.is_dynamo_compiling() is False  # the flag is put back


def test_a_plain_module_is_captured_by_torch_export_with_the_group_norm_translation(host, contract, tmp_path):
    result = export_onnx(host.head, contract, head_inputs(2), tmp_path / "head.onnx")
    assert result.capture == "torch_export" and result.capture_reason is None
    assert "aten.group_norm.default" in result.custom_translations


def test_the_export_traces_with_a_sample_whose_dynamic_dims_are_not_1():
    from omskills.contracts.samples import Sample
    from omskills.stages.toolchain import _tracing_sample

    def sample(batch: int) -> Sample:
        return Sample(inputs={"x": torch.zeros(batch, 4)}, outputs={}, candidate="c", call_index=batch)

    dims = {"x": {0: "x_d0"}}
    assert _tracing_sample([sample(1), sample(2), sample(3)], dims).inputs["x"].shape[0] == 2
    assert _tracing_sample([sample(1)], dims).inputs["x"].shape[0] == 1  # nothing better to take
    assert _tracing_sample([sample(1), sample(2)], {}).inputs["x"].shape[0] == 1  # static: the first


class _NormHost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def test_exports_build_the_torchlib_registry_once_and_keep_their_custom_translations(tmp_path, monkeypatch):
    from omskills.convert import export as export_module
    from torch.onnx._internal.exporter import _registration

    host = _NormHost().eval()
    [contract] = capture_contracts(host, {"norm": "norm"}, lambda: host(torch.randn(1, 8, 6, 6)))
    builds = []
    build = _registration.ONNXRegistry.from_torchlib

    def counted(opset_version):
        builds.append(opset_version)
        return build(opset_version=opset_version)

    monkeypatch.setattr(export_module, "_TORCHLIB_REGISTRIES", {})
    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", counted)
    x = torch.randn(1, 8, 6, 6) + 2.0
    paths = [export_onnx(host.norm, contract, [x], tmp_path / f"norm{k}.onnx").path for k in range(2)]

    assert len(builds) == 1  # the second export reused the first one's registry
    for path in paths:  # both with the two-pass group norm of omskills' own translation
        ops = {node.op_type for node in onnx.load(path).graph.node}
        assert "InstanceNormalization" not in ops and "ReduceMean" in ops
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        with torch.no_grad():
            np.testing.assert_allclose(
                session.run(None, {session.get_inputs()[0].name: x.numpy()})[0], host(x).numpy(), atol=1e-5
            )
    [shared] = export_module._TORCHLIB_REGISTRIES.values()
    assert not any(
        meta.is_custom for metas in shared.functions.values() for meta in metas
    )  # kept out of the shared one
    assert _registration.ONNXRegistry.from_torchlib is counted  # put back after each export


def test_an_exported_module_is_freed_once_its_owner_lets_it_go(tmp_path):
    """The exporter wraps the module's parameters, not copies; nothing it leaves behind (onnxscript's
    rewrite rules remember their last match) may keep them alive after the export."""
    import gc
    import weakref

    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    host = nn.Sequential(mlp).eval()
    x = torch.randn(2, 64)
    [contract] = _capture_single(host, x)
    weight = weakref.ref(mlp[0].weight)
    export_onnx(mlp, contract, [x], tmp_path / "mlp.onnx")
    del mlp, host
    gc.collect()
    assert weight() is None


def test_the_exporter_optimises_without_rules_quadratic_in_the_graph(tmp_path, monkeypatch):
    """onnxscript matches a rewrite rule whose pattern ends in several nodes (two Slices of one
    tensor -> one Split) by trying combinations of graph nodes, quadratic in the graph's size (a
    minute on a full-scale backbone): the export's optimiser runs without such rules, and the
    rules are put back afterwards."""
    from onnxscript import rewriter

    def several_ends(rules):
        return [
            rule
            for rule in rules
            if hasattr(rule, "_target_pattern") and not rule._target_pattern.has_single_output_node
        ]

    seen: list[tuple] = []
    original_init = rewriter.RewritePass.__init__

    def recording_init(self, rules, *args, **kwargs):
        seen.append(tuple(rules))
        original_init(self, rules, *args, **kwargs)

    monkeypatch.setattr(rewriter.RewritePass, "__init__", recording_init)
    rules_before = rewriter._DEFAULT_REWRITE_RULES
    assert several_ends(rules_before)  # onnxscript has such a rule: leaving it out is a real change

    class RotateHalf(nn.Module):
        def forward(self, x):
            half = x.shape[-1] // 2
            return torch.cat([-x[..., half:], x[..., :half]], dim=-1) * 2.0

    rotate = RotateHalf().eval()
    host = nn.Sequential(rotate).eval()
    x = torch.randn(2, 3, 8)
    [contract] = _capture_single(host, x)
    path = export_onnx(rotate, contract, [x], tmp_path / "rotate.onnx").path

    assert seen and not any(several_ends(rules) for rules in seen)
    assert rewriter._DEFAULT_REWRITE_RULES is rules_before
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    [out] = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_array_equal(out, rotate(x).numpy())
