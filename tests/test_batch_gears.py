"""Batches the gears do not hold: between the gears, beyond the largest, below the smallest.

A graph built with batch gears [2, 4] runs only those sizes. A call of another batch runs as
gear-sized calls, the last one padded up to a gear and the padding cut from its outputs, on ONNX
Runtime as on the OM, and each output is joined along the dim that follows the batch (an LSTM
gives its hidden states as layers x batch x hidden). A graph with an output that does not follow
the batch cannot be served that way: such a call falls back to PyTorch, and says why. So does one
whose batch items interact (batch statistics): probe_onnx runs two items together and one by one
(runtime.batch_independence), and a graph not found independent, or never checked, is not split.

The toy is a speaker encoder shaped like resemblyzer's: an LSTM over a batch of partial
utterances, the last layer's hidden state read in Python. The OM path runs on the InferSession
double (tests/doubles: ONNX Runtime underneath, the OM's gears enforced, no NPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_atc_build import built_om
from infer_session_double import install_acl_double, recording_sessions
from omskills.boundary.shape_strategy import propose_shape_strategy
from omskills.contracts import capture_contracts
from omskills.contracts.batch_axes import BatchAxes, batch_axes
from omskills.convert.export import export_onnx
from omskills.records.contracts import ContractSpec, ShapeStrategy
from omskills.records.deploy import Artifact, ArtifactFile, DeployedGraph
from omskills.runtime import open_backend
from omskills.runtime.batch_independence import UNCHECKED, check_batch_independence
from omskills.runtime.serving import open_graph
from omskills.splicing.splice import splice
from torch import nn

STUDIED = (2, 4)  # the batches the study saw: gears [2] and [4]
BEYOND = (9, 5, 1)  # beyond the largest gear, between... and below the smallest
RUN = [10, 6, 2]  # items each runs in all: its own and one padded item (9 = 4 + 2 + 3 padded to 4)


class Encoder(nn.Module):
    """Partial utterances (batch x frames x mels) -> one embedding each, from the LSTM's last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.linear = nn.Linear(8, 4)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.lstm(mels)
        return torch.relu(self.linear(hidden[-1]))


class Pooled(nn.Module):
    """A block whose second output sums over the batch: no dim of it follows the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.block(x)
        return y, y.sum(0)


class Centered(nn.Module):
    """A block whose items read each other: every output follows the batch, yet holds its mean."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y - y.mean(0)


class Host(nn.Module):
    """Calls its block on the first frame of each item."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor):
        return self.block(x[:, 0])


def mels(batch: int) -> torch.Tensor:
    return torch.randn(batch, 5, 6, generator=torch.Generator().manual_seed(batch))


def deployed(folder: Path, root: nn.Module, name: str, with_om: bool) -> DeployedGraph:
    """`root.<name>` studied on the STUDIED batches, exported with a dynamic batch and, with
    `with_om`, "built" by tests/fake_atc with its batch gears."""

    def run() -> None:
        with torch.no_grad():
            for batch in STUDIED:
                root(mels(batch))

    [contract] = capture_contracts(root, {name: name}, run)
    strategy = propose_shape_strategy(contract)
    assert strategy.kind == "dynamic_batch_size" and strategy.gears == [[2], [4]]
    batch_dim = {contract.inputs[0].name: {0: "batch"}}
    onnx = folder / f"{name}.onnx"
    call = _call_of(root, name, mels(4))
    export_onnx(getattr(root, name), contract, call, onnx, dynamic_dims=batch_dim)
    om = _fake_atc(folder, onnx, strategy) if with_om else None
    # what probe_onnx records: whether the batch items are computed independently
    checked = check_batch_independence(onnx, {contract.inputs[0].name: call[0].numpy()}, contract, strategy)
    return DeployedGraph(
        name=name,
        plan_candidate=name,
        module_path=name,
        contract=contract,
        strategy=strategy,
        batch_independence=checked,
        onnx=Artifact(files=[ArtifactFile(path=onnx.name, bytes=onnx.stat().st_size)]),
        om=Artifact(files=[ArtifactFile(path=om.name, bytes=om.stat().st_size)]) if om else None,
    )


def _call_of(root: nn.Module, name: str, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensors `root.<name>` is called with when `root` is called on `x`."""
    seen: list[torch.Tensor] = []
    hook = getattr(root, name).register_forward_pre_hook(lambda module, args: seen.extend(args))
    with torch.no_grad():
        root(x)
    hook.remove()
    return seen


def _fake_atc(folder: Path, onnx: Path, strategy: ShapeStrategy) -> Path:
    return built_om(folder, onnx, strategy, onnx.with_suffix(""))


@pytest.fixture(scope="module")
def speaker(tmp_path_factory) -> tuple[Encoder, DeployedGraph, Path]:
    folder = tmp_path_factory.mktemp("speaker")
    torch.manual_seed(0)
    encoder = Encoder().eval()
    return encoder, deployed(folder, encoder, "lstm", with_om=True), folder


def served(encoder: Encoder, graph: DeployedGraph, folder: Path, backend: str) -> tuple[list, list, object]:
    """PyTorch's embeddings and the spliced graph's for each batch of BEYOND, and the splice's stats."""
    with torch.no_grad():
        want = [encoder(mels(batch)) for batch in BEYOND]
    runner = open_graph(graph, folder, backend)
    with runner, splice(encoder, [(graph.contract, runner)], strategies={graph.name: graph.strategy}) as handle:
        with torch.no_grad():
            got = [encoder(mels(batch)) for batch in BEYOND]
    return want, got, (handle, runner)


def test_each_output_of_an_lstm_is_joined_along_the_dim_that_follows_the_batch(speaker):
    _, graph, _ = speaker
    axes = batch_axes(graph.contract, graph.strategy)
    # its output is batch-first, its hidden and cell states layers x batch x hidden
    assert axes == BatchAxes(inputs={"input": 0}, outputs={"out_0": 0, "out_1_0": 1, "out_1_1": 1})


def test_batches_beyond_between_and_below_the_gears_run_on_onnxruntime_as_gear_sized_calls(speaker):
    encoder, graph, folder = speaker
    assert graph.batch_independence.independent, graph.batch_independence.reason
    want, got, (handle, runner) = served(encoder, graph, folder, "onnxruntime")
    assert handle.fallbacks() == []
    assert [sum(gears) for gears in runner.chunk_sizes] == RUN and {g for c in runner.chunk_sizes for g in c} <= {2, 4}
    assert runner.describe().endswith("batch served by gears [2, 4]")
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_om_runs_only_its_gears_and_serves_the_same_batches_equal_to_pytorch(speaker, monkeypatch):
    encoder, graph, folder = speaker
    install_acl_double(monkeypatch)
    sessions = recording_sessions(monkeypatch)
    want, got, (handle, runner) = served(encoder, graph, folder, "om")
    assert handle.fallbacks() == []
    [session] = sessions  # the double refuses any batch that is no gear of the OM
    assert [call.feed_shapes[0][0] for call in session.calls] == [g for chunks in runner.chunk_sizes for g in chunks]
    assert [sum(gears) for gears in runner.chunk_sizes] == RUN
    assert {call.mode for call in session.calls} == {"dymbatch"}
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_without_its_gears_each_of_these_calls_fell_back(speaker):
    """What verify counted before: the same graph, opened as a plain session, serves the gears only."""
    encoder, graph, folder = speaker
    plain = open_backend(folder / graph.onnx.path, "onnxruntime")
    with plain, splice(encoder, [(graph.contract, plain)], strategies={graph.name: graph.strategy}) as handle:
        with torch.no_grad():
            for batch in BEYOND:
                encoder(mels(batch))
    assert [event.kind for event in handle.fallbacks()] == ["shape"] * len(BEYOND)
    assert handle.stats()[0].fallbacks == len(BEYOND)


def test_a_graph_with_an_output_summed_over_the_batch_falls_back_and_says_why(tmp_path):
    torch.manual_seed(0)

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pooled = Pooled()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.pooled(x[:, 0])

    host = Host().eval()
    graph = deployed(tmp_path, host, "pooled", with_om=False)
    why = "output out_1 has no dim that follows the batch (it reduces over the batch, or is fixed)"
    assert batch_axes(graph.contract, graph.strategy) == why
    assert f"A batch that is no gear falls back to PyTorch: it cannot run as gear-sized calls ({why})" in (
        graph.strategy.rationale
    )
    x = mels(9)
    with torch.no_grad():
        want = host(x)
    runner = open_graph(graph, tmp_path, "onnxruntime")
    with runner, splice(host, [(graph.contract, runner)], strategies={"pooled": graph.strategy}) as handle:
        with torch.no_grad():
            got = host(x)
    [event] = handle.fallbacks()
    assert event.kind == "shape" and event.reason.endswith(f"the batch cannot run as gear-sized calls: {why}")
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def test_an_output_with_two_dims_of_the_batch_size_is_not_guessed():
    contract = ContractSpec.model_validate(
        {
            "candidate": "pairs",
            "module_path": "pairs",
            "module_class": "Pairs",
            "parent_path": "",
            "attribute": "pairs",
            "calls": 2,
            "in_spec": "",
            "out_spec": "",
            "inputs": [{"name": "x", "tree_path": "args[0]", "shape": [2, 3], "dtype": "float32", "device": "cpu"}],
            "outputs": [{"name": "out", "tree_path": "out", "shape": [2, 2], "dtype": "float32", "device": "cpu"}],
            "call_shapes": [{"inputs": [[b, 3]], "outputs": [[b, b]]} for b in STUDIED],
        }
    )
    strategy = ShapeStrategy(kind="dynamic_batch_size", input_shapes={"x": [-1, 3]}, gears=[[2], [4]], rationale="")
    assert batch_axes(contract, strategy) == (
        "output out has several dims of the batch's size in every call ([0, 1]), none known to be the batch"
    )


def served_block(folder: Path, host: Host, graph: DeployedGraph, batch: int):
    """PyTorch's answer for a batch that is no gear, the spliced graph's, and the splice's fallbacks."""
    x = mels(batch)
    with torch.no_grad():
        want = host(x)
    runner = open_graph(graph, folder, "onnxruntime")
    with runner, splice(host, [(graph.contract, runner)], strategies={"block": graph.strategy}) as handle:
        with torch.no_grad():
            got = host(x)
    return want, got, handle.fallbacks()


def test_a_graph_whose_batch_items_interact_is_not_split_and_says_which_output(tmp_path):
    torch.manual_seed(0)
    host = Host(Centered()).eval()
    graph = deployed(tmp_path, host, "block", with_om=False)
    assert isinstance(batch_axes(graph.contract, graph.strategy), BatchAxes)  # its shapes allow a split
    checked = graph.batch_independence
    assert not checked.independent
    assert checked.reason.startswith("batch items interact: out differs by ") and "when the batch is split" in (
        checked.reason
    )
    want, got, fallbacks = served_block(tmp_path, host, graph, 9)
    [event] = fallbacks
    assert event.kind == "shape" and event.reason.endswith(
        f"the batch cannot run as gear-sized calls: {checked.reason}"
    )
    torch.testing.assert_close(got, want)
    # a gear still runs on the graph
    assert served_block(tmp_path, host, graph, 4)[2] == []


def test_a_sample_of_one_item_is_paired_with_a_perturbed_copy(tmp_path, speaker):
    torch.manual_seed(0)
    host = Host(Centered()).eval()
    centered = deployed(tmp_path, host, "block", with_om=False)
    one = {"x": mels(1)[:, 0].numpy()}
    checked = check_batch_independence(tmp_path / "block.onnx", one, centered.contract, centered.strategy)
    assert not checked.independent and "paired with a perturbed copy" in checked.reason
    _, lstm, folder = speaker
    one = {"input": mels(1).numpy()}
    checked = check_batch_independence(folder / "lstm.onnx", one, lstm.contract, lstm.strategy)
    assert checked.independent and "paired with a perturbed copy" in checked.reason


def test_a_graph_recorded_before_the_check_is_not_split(speaker):
    encoder, graph, folder = speaker
    before = graph.model_copy(update={"batch_independence": None})
    runner = open_graph(before, folder, "onnxruntime")
    with runner, splice(encoder, [(before.contract, runner)], strategies={before.name: before.strategy}) as handle:
        with torch.no_grad():
            encoder(mels(9))
    [event] = handle.fallbacks()
    assert event.kind == "shape" and event.reason.endswith(UNCHECKED)
