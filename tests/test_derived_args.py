"""A non-tensor argument the source computes from input shapes (SAM 3.1's `num_obj_ptr_tokens`).

It varies call to call, which would freeze a graph to one value; declared as a formula over the
input shapes, the candidate stays one graph: the graph computes it, the splice checks it. Left
undeclared, each observed value gets a graph of its own.
"""

from __future__ import annotations

import pytest
import torch
from omskills.boundary.analysis import analyze_boundary
from omskills.boundary.shape_strategy import propose_shape_strategy
from omskills.contracts import capture_contracts
from omskills.convert.export import export_onnx
from omskills.errors import OmskillsError
from omskills.records.contracts import DimRef, QuantityLimit, QuantitySchedule, ShapeDerivedArg
from omskills.runtime import open_backend
from omskills.splicing.splice import splice
from torch import nn

HW, PER_POINTER = 4, 2


class MemoryAttention(nn.Module):
    """Like SAM 3.1's decoupled memory attention: the last `num_obj_ptr_tokens` rows of `memory`
    are object pointers, treated apart from the image rows."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, src, memory_image, memory, num_obj_ptr_tokens: int = 0):
        image_rows = memory[: memory_image.shape[0]] + memory_image
        pointers = memory[memory.shape[0] - num_obj_ptr_tokens :]
        return self.proj(src) + image_rows.mean(0) + 2 * pointers.sum(0)


class Tracker(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = MemoryAttention()

    def step(self, frames: int, pointers: int):
        src = torch.randn(HW, 1, 3)
        memory_image = torch.randn(HW * frames, 1, 3)
        memory = torch.randn(HW * frames + PER_POINTER * pointers, 1, 3)
        return self.attention(src, memory_image, memory, num_obj_ptr_tokens=PER_POINTER * pointers)


DERIVED = {
    "attention": {
        "kwargs['num_obj_ptr_tokens']": ShapeDerivedArg(
            expression="memory.shape[0] - memory_image.shape[0]", evidence="test"
        )
    }
}


def _limits():
    frames = QuantityLimit(
        quantity="memory_frames",
        low=1,
        high=3,
        dims=[DimRef(input="memory_image", dim=0, scale=HW), DimRef(input="memory", dim=0, scale=HW)],
    )
    pointers = QuantityLimit(
        quantity="pointer_frames", low=1, high=4, dims=[DimRef(input="memory", dim=0, scale=PER_POINTER)]
    )
    tied = QuantitySchedule(
        quantities=["memory_frames", "pointer_frames"], rows=[[min(t, 3), t] for t in range(1, 5)], evidence="frame t"
    )
    return [frames, pointers, tied]


def test_an_argument_that_varies_but_follows_the_shapes_keeps_the_candidate_exportable(tmp_path):
    contract = _capture(Tracker(), [(1, 1), (2, 2)], tmp_path)
    [arg] = contract.non_tensor_args
    assert not arg.constant and arg.derived is not None
    decision = analyze_boundary(contract)
    assert decision.exportable
    assert any("memory.shape[0] - memory_image.shape[0]" in reason for reason in decision.reasons)


def _capture(tracker: Tracker, steps, tmp_path, derived=DERIVED):
    (contract,) = _capture_all(tracker, steps, tmp_path, derived)
    return contract


def _capture_all(tracker: Tracker, steps, tmp_path, derived=DERIVED):
    def run():
        torch.manual_seed(0)
        with torch.no_grad():
            for frames, pointers in steps:
                tracker.step(frames, pointers)

    return capture_contracts(
        tracker, {"attention": "attention"}, run, samples_dir=tmp_path, relative_to=tmp_path, derived_args=derived
    )


def test_without_the_declaration_or_when_a_call_disagrees_each_value_gets_its_own_graph(tmp_path):
    undeclared = _capture_all(Tracker(), [(1, 1), (2, 2)], tmp_path / "a", derived={})
    assert [c.dispatch.on for c in undeclared] == [
        {"kwargs['num_obj_ptr_tokens']": 2},
        {"kwargs['num_obj_ptr_tokens']": 4},
    ]
    assert all(analyze_boundary(c).exportable and c.non_tensor_args[0].derived is None for c in undeclared)

    class CountsOnlyOnFirstCall(Tracker):
        calls = 0

        def step(self, frames, pointers):
            self.calls += 1
            if self.calls == 1:
                return super().step(frames, pointers)
            memory_image = torch.randn(HW * frames, 1, 3)
            memory = torch.randn(HW * frames + PER_POINTER * pointers, 1, 3)
            return self.attention(torch.randn(HW, 1, 3), memory_image, memory, num_obj_ptr_tokens=0)

    disagreeing = _capture_all(CountsOnlyOnFirstCall(), [(1, 1), (2, 2)], tmp_path / "b")
    assert [c.dispatch.on["kwargs['num_obj_ptr_tokens']"] for c in disagreeing] == [2, 0]
    assert disagreeing[1].non_tensor_args[0].derived is None  # 0 is not what the formula gives

    wrong_name = {"attention": {"kwargs['other']": DERIVED["attention"]["kwargs['num_obj_ptr_tokens']"]}}
    with pytest.raises(OmskillsError, match=r"derived argument\(s\) \[\"kwargs\['other'\]\"\] are not"):
        _capture(Tracker(), [(1, 1)], tmp_path / "c", derived=wrong_name)


def test_the_exported_graph_computes_the_argument_and_the_splice_checks_it_per_call(tmp_path):
    tracker = Tracker().eval()
    contract = _capture(tracker, [(1, 1), (2, 2)], tmp_path)
    strategy = propose_shape_strategy(contract, source_limits=_limits())
    assert strategy.kind == "dynamic_dims" and len(strategy.gears) == 4
    exported = export_onnx(
        tracker.attention,
        contract,
        [torch.randn(HW, 1, 3), torch.randn(2 * HW, 1, 3), torch.randn(2 * HW + 2 * PER_POINTER, 1, 3)],
        tmp_path / "attention.onnx",
        dynamic_dims={"memory_image": {0: "memory_image_d0"}, "memory": {0: "memory_d0"}},
    )

    steps = [(1, 1), (2, 2), (3, 3), (3, 4)]  # gears never traced: (3, 3) and (3, 4)
    torch.manual_seed(1)
    with torch.no_grad():
        want = [tracker.step(f, p) for f, p in steps]
    with (
        open_backend(exported.path, "onnxruntime") as backend,
        splice(tracker, [(contract, backend)], strategies={"attention": strategy}) as handle,
    ):
        torch.manual_seed(1)
        with torch.no_grad():
            got = [tracker.step(f, p) for f, p in steps]
            # A caller passing a count that is not the shape difference gets PyTorch.
            tracker.attention(
                torch.randn(HW, 1, 3), torch.randn(HW, 1, 3), torch.randn(HW + 2, 1, 3), num_obj_ptr_tokens=0
            )
        [stats] = handle.stats()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert (stats.backend_calls, stats.fallbacks) == (4, 1)
    assert "not memory.shape[0] - memory_image.shape[0] = 2" in stats.fallback_reasons[0]
