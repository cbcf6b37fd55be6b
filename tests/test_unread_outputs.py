"""Outputs the host never reads stay on the device.

A block returns a big tensor and a small one, and its host keeps only the small one (as an LSTM's
caller keeps the last hidden state, not the per-step outputs). The study sees which outputs the
host reads after each call; the spliced graph then copies back only those, and the traffic meter
counts only them. The big one stands in the host's tuple as a placeholder that copies it back at
the first read of its values: a host that reads it after all gets the right values, late, counted
and logged. A host that does read it in the study keeps it.

The graphs are real exports run by ONNX Runtime; the OM path runs on the InferSession double
(tests/doubles: ONNX Runtime underneath, device tensors that must be copied back, no NPU).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fake_atc_build import built_om
from infer_session_double import install_acl_double, recording_sessions
from omskills.boundary.shape_strategy import propose_shape_strategy
from omskills.contracts import capture_contracts
from omskills.convert.export import export_onnx
from omskills.records.contracts import ContractSpec
from omskills.records.deploy import Artifact, ArtifactFile, DeployedGraph
from omskills.runtime.batch_independence import check_batch_independence
from omskills.runtime.serving import open_graph
from omskills.splicing.splice import splice
from omskills.splicing.unfetched import Unfetched
from torch import nn

BATCHES = (2, 3)
STEPS, WIDTH = 16, 64  # the big output: batch x STEPS x WIDTH floats; the small one: batch x 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Linear(8, STEPS * WIDTH)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        big = torch.tanh(self.expand(x)).reshape(-1, STEPS, WIDTH)
        return big, self.head(x)


class Host(nn.Module):
    """Reads the small output only, or (`reads_big`) the big one too."""

    def __init__(self, reads_big: bool = False) -> None:
        super().__init__()
        self.block = Block()
        self.reads_big = reads_big

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big, small = self.block(x)
        return small * 2 + big.mean() if self.reads_big else small * 2


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))


def studied(host: Host) -> ContractSpec:
    """The block's contract, captured while the host runs as its application would (results read)."""

    def run() -> None:
        with torch.no_grad():
            for batch in BATCHES:
                host(inputs(batch)).numpy()

    [contract] = capture_contracts(host, {"block": "block"}, run)
    return contract


def deployed(folder: Path, host: Host, contract: ContractSpec) -> DeployedGraph:
    """The block exported with a dynamic batch and "built" by tests/fake_atc with its batch gears."""
    strategy = propose_shape_strategy(contract)
    onnx = folder / "block.onnx"
    export_onnx(host.block, contract, [inputs(3)], onnx, dynamic_dims={contract.inputs[0].name: {0: "batch"}})
    om = built_om(folder, onnx, strategy, folder / "block")
    return DeployedGraph(
        name="block",
        plan_candidate="block",
        module_path="block",
        contract=contract,
        strategy=strategy,
        # what probe_onnx records: the block computes each batch item on its own
        batch_independence=check_batch_independence(
            onnx, {contract.inputs[0].name: inputs(2).numpy()}, contract, strategy
        ),
        onnx=Artifact(files=[ArtifactFile(path=onnx.name, bytes=onnx.stat().st_size)]),
        om=Artifact(files=[ArtifactFile(path=om.name, bytes=om.stat().st_size)]),
    )


@pytest.fixture(scope="module")
def small_only(tmp_path_factory) -> tuple[Host, DeployedGraph, Path]:
    folder = tmp_path_factory.mktemp("small_only")
    torch.manual_seed(0)
    host = Host().eval()
    return host, deployed(folder, host, studied(host)), folder


def spliced_run(host: Host, graph: DeployedGraph, folder: Path, backend: str, read=lambda out: out):
    """PyTorch's answer and the spliced one for a call of batch 3, the splice's handle and stats."""
    x = inputs(3)
    with torch.no_grad():
        want = read(host.block(x))
    runner = open_graph(graph, folder, backend)
    with runner, splice(host, [(graph.contract, runner)], strategies={"block": graph.strategy}) as handle:
        with torch.no_grad():
            got = read(host.block(x))
        traffic = handle.traffic.steps()
    [stats] = handle.stats()
    [graph_traffic] = [g for step in traffic for g in step.graphs]
    return want, got, graph_traffic, stats


def nbytes(*shape: int) -> int:
    return int(torch.zeros(shape).nbytes)


def test_the_study_marks_the_output_its_host_never_reads(small_only):
    _, graph, _ = small_only
    big, small = graph.contract.outputs
    assert (big.unread, small.unread) == (True, False)


def test_an_output_the_host_reads_is_never_marked_and_nor_are_outputs_no_one_was_seen_to_read():
    torch.manual_seed(0)
    reads_big = studied(Host(reads_big=True).eval())
    assert [spec.unread for spec in reads_big.outputs] == [False, False]

    host = Host().eval()

    def discards() -> None:  # no output read at all: what the host reads is not seen, so nothing is left behind
        with torch.no_grad():
            host.block(inputs(2))

    [contract] = capture_contracts(host, {"block": "block"}, discards)
    assert [spec.unread for spec in contract.outputs] == [False, False]


def test_only_the_output_the_host_reads_crosses_back_and_the_results_are_unchanged(small_only):
    host, graph, folder = small_only
    x = inputs(3)
    with torch.no_grad():
        want = host(x)
    runner = open_graph(graph, folder, "onnxruntime")
    with runner, splice(host, [(graph.contract, runner)], strategies={"block": graph.strategy}) as handle:
        with torch.no_grad():
            got = host(x)
        [step] = handle.traffic.steps()
    [moved] = step.graphs
    assert moved.bytes_out == nbytes(3, 4) and moved.bytes_in == nbytes(3, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert handle.stats()[0].held_outputs_read == 0


def test_an_output_the_host_reads_in_the_study_crosses_back(tmp_path):
    torch.manual_seed(0)
    host = Host(reads_big=True).eval()
    graph = deployed(tmp_path, host, studied(host))
    want, got, moved, stats = spliced_run(host, graph, tmp_path, "onnxruntime")
    assert moved.bytes_out == nbytes(3, STEPS, WIDTH) + nbytes(3, 4)
    assert not any(isinstance(tensor, Unfetched) for tensor in got)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_read_the_study_did_not_see_copies_the_output_back_then_counted_and_logged(small_only, caplog):
    host, graph, folder = small_only
    held: list[bool] = []

    def reads_both(out):
        big, small = out
        if isinstance(big, Unfetched):
            assert big.shape == (3, STEPS, WIDTH) and big.dtype == torch.float32  # known without the values
            held.append(not big.fetched)
        return big.sum(-1), small

    with caplog.at_level(logging.WARNING, logger="omskills.splicing.splice"):
        want, got, moved, stats = spliced_run(host, graph, folder, "onnxruntime", reads_both)
    assert held == [True]  # the spliced run's big output was still held when the host read it
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert stats.held_outputs_read == 1 and stats.fallbacks == 0
    assert moved.bytes_out == nbytes(3, 4) + nbytes(3, STEPS, WIDTH)  # the late copy counted
    assert "block output out_0, left on the device as the study saw no host code read it, was read" in caplog.text


def test_the_om_leaves_the_unread_output_in_device_memory_until_it_is_read(small_only, monkeypatch):
    host, graph, folder = small_only
    install_acl_double(monkeypatch)
    sessions = recording_sessions(monkeypatch)
    x = inputs(3)
    with torch.no_grad():
        want = host.block(x)
    runner = open_graph(graph, folder, "om")
    with runner, splice(host, [(graph.contract, runner)], strategies={"block": graph.strategy}) as handle:
        with torch.no_grad():
            big, small = host.block(x)
        [call] = sessions[0].calls
        assert call.out_array is False and call.copied_back == ["out_1"]  # the small output only
        assert handle.traffic.steps()[0].graphs[0].bytes_out == nbytes(3, 4)
        torch.testing.assert_close(small, want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(big * 1, want[0], rtol=1e-5, atol=1e-6)  # read now: copied back now
        assert call.copied_back == ["out_1", "out_0"] and handle.stats()[0].held_outputs_read == 1


def test_a_batch_run_as_gear_sized_calls_holds_each_chunk_and_joins_them_when_read(small_only):
    host, graph, folder = small_only
    x = inputs(5)  # gears 2 and 3: 5 runs as 2 + 3
    with torch.no_grad():
        want = host.block(x)
    runner = open_graph(graph, folder, "onnxruntime")
    with runner, splice(host, [(graph.contract, runner)], strategies={"block": graph.strategy}) as handle:
        with torch.no_grad():
            big, small = host.block(x)
            [step] = handle.traffic.steps()
            assert isinstance(big, Unfetched) and big.shape == (5, STEPS, WIDTH)
            assert step.graphs[0].bytes_out == nbytes(5, 4) and sorted(runner.chunk_sizes[0]) == [2, 3]
            torch.testing.assert_close(big + 0, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(small, want[1], rtol=1e-5, atol=1e-6)


class RunsEveryOutput:
    """A runner written before runners could leave outputs behind: `run(feeds)`, every output back."""

    holds_values = False

    def __init__(self, opened) -> None:
        self.opened = opened

    def __getattr__(self, name):
        return getattr(self.opened, name)

    def run(self, feeds):
        return self.opened.run(feeds)


def test_a_runner_that_copies_every_output_back_still_serves_and_is_counted_for_all(small_only):
    host, graph, folder = small_only
    x = inputs(3)
    with torch.no_grad():
        want = host.block(x)
    runner = RunsEveryOutput(open_graph(graph, folder, "onnxruntime"))
    with splice(host, [(graph.contract, runner)], strategies={"block": graph.strategy}) as handle:
        with torch.no_grad():
            got = host.block(x)
        [step] = handle.traffic.steps()
    runner.opened.close()
    assert handle.fallbacks() == [] and not any(isinstance(tensor, Unfetched) for tensor in got)
    assert step.graphs[0].bytes_out == nbytes(3, STEPS, WIDTH) + nbytes(3, 4)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
