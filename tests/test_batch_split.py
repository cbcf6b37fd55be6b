"""ONNX Runtime runs a batch in chunks when the whole batch does not fit in memory.

On CPU, ORT materialises attention scores: the full-scale SAM 3.1 backbone on a 4-frame call
needs more than 24 GB. A candidate with a `dynamic_batch_size` strategy whose outputs all follow
the batch can be run as chunks and concatenated; probe_onnx falls back to that when the process
probing the whole batch dies, and records it so that optimise and verify run it the same way.
Whether the candidate is really item-wise is checked against PyTorch's whole-batch outputs.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from export_helpers import BATCH_DIMS, head_inputs, make_host, one_graph_task
from omskills.boundary.shape_strategy import propose_shape_strategy
from omskills.contracts import capture_contracts
from omskills.errors import StageError
from omskills.records.task import load_record, save_record
from omskills.runtime import open_backend
from omskills.runtime.batch_split import SplitBatchBackend, batch_split_for
from omskills.splicing.splice import splice
from torch import nn

BATCHES = (2, 5)  # observed batch sizes: gears [2] and [5]


@pytest.fixture(scope="module")
def head_task(tmp_path_factory):
    """A task record for the toy head: contract and samples captured on calls with batches 2 and 5,
    a dynamic_batch_size strategy proposed from them, and an ONNX export with a dynamic batch."""
    folder = tmp_path_factory.mktemp("head_task")
    host = make_host()

    def run() -> None:
        with torch.no_grad():
            for batch in BATCHES:
                host(torch.randn(batch, 4))

    path = one_graph_task(folder, host, "head", run, head_inputs(2), BATCH_DIMS, "batch-split-test")
    return path, host


def test_a_batch_strategy_whose_outputs_follow_the_batch_can_be_split(head_task):
    record = load_record(head_task[0])
    contract, strategy = record.contracts["head"], record.boundaries["head"].shape_strategy
    assert strategy.kind == "dynamic_batch_size" and strategy.gears == [[2], [5]]

    split = batch_split_for(contract, strategy, 2, "test")

    assert split.max_batch == 2
    assert split.input_axes == {"x": 0, "pair_0": 0, "pair_1": 0}
    assert set(split.output_axes) == {spec.name for spec in contract.outputs}


def test_a_candidate_with_an_output_that_does_not_follow_the_batch_cannot_be_split():
    class Pool(nn.Module):
        def forward(self, x):
            return x * 2, x.sum(0)  # the second output has no batch axis

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = Pool()

        def forward(self, x):
            return self.pool(x)

    root = Root().eval()
    [contract] = capture_contracts(root, {"pool": "pool"}, lambda: [root(torch.randn(b, 3)) for b in BATCHES])
    strategy = propose_shape_strategy(contract)
    assert strategy.kind == "dynamic_batch_size"

    assert batch_split_for(contract, strategy, 2, "test") is None
    assert batch_split_for(contract, strategy.model_copy(update={"kind": "dynamic_dims"}), 2, "test") is None


def test_chunks_of_a_batch_give_the_whole_batch_outputs_on_onnxruntime(head_task):
    path, host = head_task
    record = load_record(path)
    split = batch_split_for(record.contracts["head"], record.boundaries["head"].shape_strategy, 2, "test")
    x = np.random.default_rng(0).standard_normal((5, 4), dtype=np.float32)
    feeds = {"x": x, "pair_0": np.ascontiguousarray(x[:, :3]), "pair_1": np.ascontiguousarray(x[:, 1:])}
    onnx_path = path.parent / record.exports["head"].path

    with open_backend(onnx_path, "onnxruntime") as whole_backend:
        whole = whole_backend.run(feeds)
    with SplitBatchBackend(open_backend(onnx_path, "onnxruntime"), split) as chunked:
        got = chunked.run(feeds)
        small = chunked.run({k: v[:2] for k, v in feeds.items()})

    assert chunked.chunked_calls == 1  # 5 items ran as 2 + 2 + 1; the batch of 2 ran whole
    assert list(got) == list(whole)
    for name in whole:
        np.testing.assert_allclose(got[name], whole[name], rtol=1e-6, atol=1e-6)
        assert small[name].shape[0] == 2


def test_a_spliced_candidate_on_a_split_backend_answers_like_pytorch(head_task):
    path, host = head_task
    record = load_record(path)
    contract = record.contracts["head"]
    split = batch_split_for(contract, record.boundaries["head"].shape_strategy, 2, "test")
    x = torch.randn(5, 4)
    with torch.no_grad():
        want = host(x)

    backend = SplitBatchBackend(open_backend(path.parent / record.exports["head"].path, "onnxruntime"), split)
    with backend, splice(host, [(contract, backend)]) as handle:
        with torch.no_grad():
            got = host(x)

    assert handle.fallbacks() == [] and backend.chunked_calls == 1
    torch.testing.assert_close(got["y"], want["y"], rtol=1e-5, atol=1e-6)
    assert torch.equal(got["best"], want["best"])


def _probe_that_dies_on_a_whole_batch(path, sample_paths, split=None):
    """What the OOM killer did to the full-scale backbone's probe: the whole batch kills the child."""
    from omskills.convert.optimize import probe_samples  # the real one: this runs in a spawned child

    if split is None:
        os._exit(137)
    return probe_samples(path, sample_paths, split)


def test_a_probe_that_dies_on_the_whole_batch_is_run_again_in_chunks_and_the_split_is_recorded(
    head_task, tmp_path, monkeypatch
):
    import shutil

    import omskills.stages.toolchain as toolchain
    from omskills.stages.delivery import known_limits
    from omskills.stages.spliced_runs import open_spliced

    task = tmp_path / "task.yaml"
    shutil.copytree(head_task[0].parent, tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr(toolchain, "ISOLATE_MIN_BYTES", 0)  # probe in a child, as for models over 512 MB
    monkeypatch.setattr(toolchain, "probe_samples", _probe_that_dies_on_a_whole_batch)

    report = toolchain.probe_candidate(task, "head")

    assert report.verdict == "pass" and report.batch_chunks_of == 2
    assert {o.shape[0] for o in report.outputs} == {2}  # the samples' first chunks: one shape, one run
    record = load_record(task)
    split = record.toolchain["head"].batch_split
    assert split.max_batch == 2 and "died" in split.reason  # the smallest gear
    assert "batch in chunks of 2, one first chunk per shape probed" in record.decisions[-1].why
    checked = record.toolchain["head"].batch_independence  # checked in a child too, on two items
    assert checked.independent and "batch independent: 2 items" in record.decisions[-1].why
    spliced_backend = open_spliced(record, tmp_path, "head", "onnxruntime")
    assert isinstance(spliced_backend, SplitBatchBackend) and spliced_backend.split == split
    assert any(
        limit.startswith("head ran on ONNX Runtime with the batch in chunks of 2") for limit in known_limits(record, [])
    )


def test_a_probe_that_dies_with_no_way_to_split_the_batch_is_an_error_naming_the_death(
    head_task, tmp_path, monkeypatch
):
    import shutil

    import omskills.stages.toolchain as toolchain

    task = tmp_path / "task.yaml"
    shutil.copytree(head_task[0].parent, tmp_path, dirs_exist_ok=True)
    record = load_record(task)
    strategy = record.boundaries["head"].shape_strategy
    record.boundaries["head"].shape_strategy = strategy.model_copy(update={"kind": "dynamic_dims"})
    save_record(record, task)
    monkeypatch.setattr(toolchain, "ISOLATE_MIN_BYTES", 0)
    monkeypatch.setattr(toolchain, "probe_samples", _probe_that_dies_on_a_whole_batch)

    with pytest.raises(StageError, match="the process probing head.onnx died"):
        toolchain.probe_candidate(task, "head")
    after = load_record(task)
    assert "head" not in after.toolchain or after.toolchain["head"].batch_split is None
