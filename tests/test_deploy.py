"""Deploying what was adapted: graphs opened as their artifacts require, on OM and ONNX Runtime.

No NPU here: the OM path runs against the doubles in tests/doubles (an InferSession that enforces
the mode the OM was built for, its gears and its ACL context; pyACL; the CANN provider), fed by
tests/fake_atc, whose ".om" names the ONNX it was given. Every device label says "double".
"""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime
import pytest
import torch
from fake_atc_build import built_om
from infer_session_double import (
    InferSessionDouble,
    acl_double,
    install_acl_double,
    install_fake_ais_bench,
    recording_sessions,
)
from omskills.boundary.shape_strategy import propose_shape_strategy
from omskills.contracts import capture_contracts
from omskills.convert.export import export_onnx
from omskills.records.deploy import Artifact, ArtifactFile, DeployedGraph
from omskills.runtime import BackendError, open_backend
from omskills.runtime.batch_independence import check_batch_independence
from omskills.runtime.serving import open_graph, resolve_backend
from omskills.splicing.splice import ContractViolation, splice
from torch import nn

GEARS = (1, 4)  # the batch sizes of the capture run, hence the OM's batch gears


class FrameEncoder(nn.Module):
    """Per-frame work: each item of the batch is computed on its own (what batch gears assume)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(frames)).mean(dim=(2, 3))


class Pipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = FrameEncoder()

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.encoder(frames) * 2


@pytest.fixture(scope="module")
def gear_graph(tmp_path_factory):
    """The encoder captured on batches 1 and 4, exported with a dynamic batch, and "built" by
    fake_atc with --dynamic_batch_size=1,4: (pipeline, DeployedGraph, folder)."""
    folder = tmp_path_factory.mktemp("gears")
    torch.manual_seed(0)
    pipeline = Pipeline().eval()

    def run() -> None:
        with torch.no_grad():
            for batch in GEARS:
                pipeline(torch.randn(batch, 3, 8, 8))

    [contract] = capture_contracts(pipeline, {"encoder": "encoder"}, run)
    strategy = propose_shape_strategy(contract)
    assert strategy.kind == "dynamic_batch_size" and strategy.gears == [[1], [4]]
    name = contract.inputs[0].name
    exported = export_onnx(
        pipeline.encoder,
        contract,
        [torch.randn(4, 3, 8, 8)],
        folder / "encoder.onnx",
        dynamic_dims={name: {0: "batch"}},
    )
    om = built_om(folder, folder / exported.path, strategy, folder / "encoder")
    graph = DeployedGraph(
        name="encoder",
        plan_candidate="encoder",
        module_path="encoder",
        contract=contract,
        strategy=strategy,
        # what probe_onnx records: the encoder computes each batch item on its own
        batch_independence=check_batch_independence(
            folder / "encoder.onnx", {name: torch.randn(2, 3, 8, 8).numpy()}, contract, strategy
        ),
        onnx=Artifact(files=[ArtifactFile(path="encoder.onnx", bytes=(folder / "encoder.onnx").stat().st_size)]),
        om=Artifact(files=[ArtifactFile(path="encoder.om", bytes=om.stat().st_size)]),
        precision_mode="force_fp16",
    )
    return pipeline, graph, folder


@pytest.fixture
def sessions(monkeypatch) -> list[InferSessionDouble]:
    """The InferSession and pyACL doubles installed; every session the backend opens, collected."""
    install_acl_double(monkeypatch)
    return recording_sessions(monkeypatch)


def test_a_call_of_3_against_an_om_with_gears_1_and_4_runs_as_gear_sized_chunks_equal_to_pytorch(gear_graph, sessions):
    pipeline, graph, folder = gear_graph
    frames = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        expected = pipeline(frames)
    backend = open_graph(graph, folder, "om")
    with splice(pipeline, [(graph.contract, backend)], strategies={"encoder": graph.strategy}, strict=True) as handle:
        with torch.no_grad():
            served = pipeline(frames)
    [session] = sessions
    assert [call.mode for call in session.calls] == ["dymbatch"] * 3
    assert [call.feed_shapes[0][0] for call in session.calls] == [1, 1, 1]
    assert backend.chunk_sizes == [[1, 1, 1]]
    torch.testing.assert_close(served, expected, rtol=1e-5, atol=1e-6)
    [stats] = handle.stats()
    assert stats.backend_kind == "om" and stats.fallbacks == 0 and "double, no NPU" in stats.backend_device


def test_a_gear_call_runs_whole_and_a_size_below_every_gear_is_padded_then_cut(gear_graph, sessions, monkeypatch):
    _, graph, folder = gear_graph
    only_four = graph.model_copy(update={"strategy": graph.strategy.model_copy(update={"gears": [[4]]})})
    backend = open_graph(only_four, folder, "om")
    feed = {graph.contract.inputs[0].name: np.random.default_rng(0).standard_normal((2, 3, 8, 8), dtype=np.float32)}
    padded = backend.run(feed)
    whole = open_backend(folder / "encoder.onnx", "onnxruntime").run(feed)
    assert [call.feed_shapes[0][0] for call in sessions[0].calls] == [4]
    [name] = padded
    assert padded[name].shape[0] == 2
    np.testing.assert_allclose(padded[name], whole[name], rtol=1e-6, atol=1e-7)


def test_the_infer_session_double_enforces_the_build_mode_and_its_gears(gear_graph, sessions):
    _, graph, folder = gear_graph
    session = InferSessionDouble(0, str(folder / "encoder.om"))
    three = [np.zeros((3, 3, 8, 8), np.float32)]
    with pytest.raises(RuntimeError, match=r"batch 3 is not one of the OM's gears \[\[1\], \[4\]\]"):
        session.infer(three, mode="dymbatch")
    with pytest.raises(RuntimeError, match="infer mode 'static' does not match the OM, which ATC built for 'dymbatch'"):
        session.infer([np.zeros((1, 3, 8, 8), np.float32)], mode="static")


def test_a_shape_mode_that_does_not_match_the_om_build_is_an_error_before_any_call(gear_graph, sessions):
    _, graph, folder = gear_graph
    with pytest.raises(BackendError, match="mode: 'static' does not match encoder.om"):
        open_backend(folder / "encoder.om", "om", mode="static")
    assert all(not s.calls for s in sessions)


def test_om_calls_run_in_the_sessions_acl_context_and_give_the_callers_context_back(gear_graph, sessions):
    _, graph, folder = gear_graph
    acl = acl_double
    backend = open_graph(graph, folder, "om")
    torch_npu_context, _ = acl.rt.create_context(0)  # what torch_npu makes current on its thread
    feed = {graph.contract.inputs[0].name: np.zeros((4, 3, 8, 8), np.float32)}
    backend.run(feed)
    assert acl.rt.get_context()[0] == torch_npu_context
    with pytest.raises(RuntimeError, match="107003"):  # the double, called without the switch
        sessions[0].infer([feed[graph.contract.inputs[0].name]], mode="dymbatch")


def test_outside_the_contract_strict_mode_raises_and_default_mode_falls_back_counted(gear_graph, sessions):
    pipeline, graph, folder = gear_graph
    odd = torch.randn(2, 3, 6, 6)  # another frame size: no graph serves it
    with torch.no_grad():
        expected = pipeline(odd)
    for strict in (True, False):
        backend = open_graph(graph, folder, "om")
        with splice(
            pipeline, [(graph.contract, backend)], strategies={"encoder": graph.strategy}, strict=strict
        ) as handle:
            if strict:
                with pytest.raises(ContractViolation, match=r"encoder call 1 is outside its contract \(shape\)"):
                    pipeline(odd)
            else:
                with torch.no_grad():
                    torch.testing.assert_close(pipeline(odd), expected)
                assert [e.kind for e in handle.fallbacks()] == ["shape"]


def test_the_cann_provider_gets_the_device_and_the_chosen_precision_mode(gear_graph, monkeypatch):
    from cann_provider_double import install_cann_provider_double

    _, graph, folder = gear_graph
    created = install_cann_provider_double(monkeypatch)
    backend = open_graph(graph, folder, "onnxruntime", device_id=3)
    assert backend.device == "CANNExecutionProvider"
    [session] = created
    assert session.cann_options == {"device_id": "3", "precision_mode": "force_fp16"}
    with pytest.raises(Exception, match="precision_mode 'fp8' is not one of"):
        onnxruntime.InferenceSession(
            str(folder / "encoder.onnx"), providers=[("CANNExecutionProvider", {"precision_mode": "fp8"})]
        )


def test_auto_chooses_the_om_only_where_every_graph_has_one_and_ais_bench_is_there(gear_graph, monkeypatch, caplog):
    _, graph, _ = gear_graph
    monkeypatch.setitem(__import__("sys").modules, "ais_bench.infer.interface", None)
    with caplog.at_level(logging.INFO, logger="omskills.runtime.serving"):
        assert resolve_backend("auto", [graph]) == "onnxruntime"
    assert "ais_bench is not installed" in caplog.text
    install_fake_ais_bench(monkeypatch)
    assert resolve_backend("auto", [graph]) == "om"
    assert resolve_backend("auto", [graph, graph.model_copy(update={"name": "other", "om": None})]) == "onnxruntime"
    with pytest.raises(BackendError, match="backend: 'npu' is not one of"):
        resolve_backend("npu", [graph])
