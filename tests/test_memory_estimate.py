"""ONNX Runtime's peak memory predicted from the graph, and the probe's batch split chosen from it.

At full scale a ViT backbone's probe on a 4-frame call materialises attention scores of GBs; the
OOM killer ending the child is a handled failure, not the way to find the limit. These tests use
a tiny attention block (SDPA, as SAM's ViT calls it) exported with a dynamic batch.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from export_helpers import one_graph_task
from omskills.errors import InputError, StageError
from omskills.profiling.memory_estimate import (
    GraphMemory,
    choose_batch_chunk,
    probe_need_bytes,
    sample_sizes,
)
from omskills.records.task import load_record
from torch import nn
from torch.nn import functional as F

TOKENS, DIM, HEADS = 128, 16, 2
BATCHES = (2, 5)  # observed batch sizes: gears [2] and [5]
SCORE_ITEM_BYTES = HEADS * TOKENS * TOKENS * 4  # one item's attention scores, float32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Host(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


@pytest.fixture(scope="module")
def attention_task(tmp_path_factory):
    """A task record for the attention block: contract and samples captured on batches 2 and 5, a
    dynamic_batch_size strategy proposed from them, and a dynamo export with a dynamic batch."""
    folder = tmp_path_factory.mktemp("attention_task")
    torch.manual_seed(0)
    host = Host().eval()

    def run() -> None:
        with torch.no_grad():
            for batch in BATCHES:
                host(torch.randn(batch, TOKENS, DIM))

    path = one_graph_task(
        folder, host, "attn", run, [torch.randn(2, TOKENS, DIM)], {"x": {0: "batch"}}, "memory-estimate-test"
    )
    return path, host


def _onnx(task) -> GraphMemory:
    path = task[0]
    return GraphMemory(path.parent / load_record(path).exports["attn"].path)


def test_the_estimate_grows_with_the_batch_as_the_score_matrices_do(attention_task):
    graph = _onnx(attention_task)
    small, big = (graph.estimate({"x": [batch, TOKENS, DIM]}) for batch in (2, 8))

    # The weights come from the initializers' dims: the block's parameters, plus a few constants.
    parameters = sum(p.numel() * 4 for p in attention_task[1].parameters())
    assert parameters <= small.weights_bytes == big.weights_bytes <= parameters + 4096
    assert small.unknown_shapes == big.unknown_shapes == 0
    # The scores, [batch, heads, tokens, tokens], are the largest tensors, made by the MatMul.
    scores = [t for t in big.largest if t.shape == [8, HEADS, TOKENS, TOKENS]]
    assert scores and big.largest[0] in scores and any(t.op == "MatMul" for t in scores)
    # Six more items: the MatMul's scores and Softmax's output live at once, plus smaller tensors.
    growth = big.activation_bytes - small.activation_bytes
    assert 2 * 6 * SCORE_ITEM_BYTES <= growth <= 2.5 * 6 * SCORE_ITEM_BYTES
    assert big.peak_bytes == big.weights_bytes + big.folded_bytes + big.activation_bytes > big.load_bytes


def test_the_estimate_names_a_wrong_input_or_rank(attention_task):
    graph = _onnx(attention_task)
    with pytest.raises(InputError, match=r"input_shapes: \['y'\] are not inputs"):
        graph.estimate({"y": [2, TOKENS, DIM]})
    with pytest.raises(InputError, match=r"input_shapes\['x'\]: \[2, 128\] has rank 2"):
        graph.estimate({"x": [2, TOKENS]})


def test_constants_folded_at_load_count_as_weights_not_activations(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    # y = x @ concat(w, w)^T: ONNX Runtime computes concat(w, w) and its transpose once, at load.
    w = helper.make_tensor("w", TensorProto.FLOAT, [256, 512], [0.0] * (256 * 512))
    nodes = [
        helper.make_node("Concat", ["w", "w"], ["ww"], axis=0),
        helper.make_node("Transpose", ["ww"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "folded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 512])],
        initializer=[w],
    )
    path = tmp_path / "folded.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)

    estimate = GraphMemory(path).estimate({"x": [8, 512]})

    w_bytes, io_bytes = 256 * 512 * 4, 2 * 8 * 512 * 4
    assert estimate.weights_bytes == w_bytes
    assert estimate.folded_bytes == 2 * w_bytes - w_bytes  # the transposed concat stays, w goes
    assert estimate.load_bytes == w_bytes + 2 * (2 * w_bytes)  # while folding: w, ww and wt
    assert estimate.activation_bytes == io_bytes  # x and y only
    assert estimate.peak_bytes == estimate.load_bytes


def test_a_small_budget_picks_the_largest_chunk_that_fits(attention_task):
    graph = _onnx(attention_task)
    shapes, axes, gears = {"x": [8, TOKENS, DIM]}, {"x": 0}, [1, 2, 4, 8]

    def need(batch: int) -> int:
        return probe_need_bytes(graph.estimate({"x": [batch, TOKENS, DIM]}))

    roomy = choose_batch_chunk(graph, shapes, axes, gears, need(8))
    assert roomy.fits and roomy.chunk is None and roomy.batch == 8

    tight = choose_batch_chunk(graph, shapes, axes, gears, need(2))
    assert tight.fits and tight.chunk == 2 and tight.chunk_bytes == need(2) < tight.whole_bytes

    hopeless = choose_batch_chunk(graph, shapes, axes, gears, need(1) - 1)
    assert not hopeless.fits and hopeless.chunk == 1  # the smallest gear, said to be over the budget


def _probe_that_dies_on_a_whole_batch(path, sample_paths, split=None):
    """The OOM killer on a whole batch: had the prediction not split it, the child would die."""
    from omskills.convert.optimize import probe_samples  # the real one: this runs in a spawned child

    if split is None:
        os._exit(137)
    return probe_samples(path, sample_paths, split)


def _copy(attention_task, tmp_path):
    shutil.copytree(attention_task[0].parent, tmp_path, dirs_exist_ok=True)
    return tmp_path / "task.yaml"


def test_the_probe_splits_the_batch_from_the_prediction_without_a_child_dying(attention_task, tmp_path, monkeypatch):
    import omskills.stages.toolchain as toolchain

    task = _copy(attention_task, tmp_path)
    record = load_record(task)
    graph = _onnx((task, None))
    biggest = sample_sizes(
        max((tmp_path / p for p in record.contracts["attn"].samples), key=lambda p: sample_sizes(p).input_bytes)
    )
    # The budget a chunk of 2 (the smaller gear) needs: the whole batch of 5 is predicted over it.
    chunked = choose_batch_chunk(graph, biggest.inputs, {"x": 0}, [2], 0, biggest)
    assert chunked.batch == 5 and chunked.whole_bytes > chunked.chunk_bytes
    monkeypatch.setattr(toolchain, "ISOLATE_MIN_BYTES", 0)  # probe in a child, as for models over 512 MB
    monkeypatch.setattr(toolchain, "probe_samples", _probe_that_dies_on_a_whole_batch)
    monkeypatch.setattr(toolchain, "probe_budget_bytes", lambda: chunked.chunk_bytes)

    report = toolchain.probe_candidate(task, "attn")

    assert report.verdict == "pass" and report.batch_chunks_of == 2
    split = load_record(task).toolchain["attn"].batch_split
    assert split.max_batch == 2 and split.input_axes == {"x": 0}
    assert split.reason.startswith(
        f"predicted peak {chunked.whole_bytes / 2**30:.2f} GB on a batch of 5 > budget "
        f"{chunked.chunk_bytes / 2**30:.2f} GB; chunks of 2 predicted"
    )
    assert "still over the budget" not in split.reason  # the chunk of 2 fits the budget
    assert "died" not in split.reason  # no child died: the prediction chose the split
    why = load_record(task).decisions[-1].why
    assert "batch in chunks of 2, one first chunk per shape probed: predicted peak" in why


def test_a_batch_predicted_to_fit_is_probed_whole_and_the_prediction_recorded(attention_task, tmp_path, monkeypatch):
    import omskills.stages.toolchain as toolchain

    task = _copy(attention_task, tmp_path)
    monkeypatch.setattr(toolchain, "ISOLATE_MIN_BYTES", 0)
    monkeypatch.setattr(toolchain, "probe_budget_bytes", lambda: 64 * 2**30)

    report = toolchain.probe_candidate(task, "attn")

    record = load_record(task)
    assert report.verdict == "pass" and report.batch_chunks_of is None
    assert record.toolchain["attn"].batch_split is None
    assert "on a batch of 5 <= budget 64.00 GB: probing the whole batch" in record.decisions[-1].why


def _probe_that_always_dies(path, sample_paths, split=None):
    os._exit(137)


def test_a_probe_that_dies_in_the_predicted_chunks_is_a_handled_failure(attention_task, tmp_path, monkeypatch):
    import omskills.stages.toolchain as toolchain

    task = _copy(attention_task, tmp_path)
    monkeypatch.setattr(toolchain, "ISOLATE_MIN_BYTES", 0)
    monkeypatch.setattr(toolchain, "probe_samples", _probe_that_always_dies)
    monkeypatch.setattr(toolchain, "probe_budget_bytes", lambda: 0)  # the smallest gear, 2, is all it can try

    with pytest.raises(StageError, match="the process probing attn.onnx in batch chunks of 2 died"):
        toolchain.probe_candidate(task, "attn")
    after = load_record(task)
    assert "attn" not in after.toolchain or after.toolchain["attn"].batch_split is None
